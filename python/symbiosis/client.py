"""Client: a Python tenant's connection to a base executor, the C++ symbiosis::Client itself
(client_runtime/client.h) bound by the extension module. The transports (tcp, shm, cuda-ipc,
nccl), the handshake, reconnection after an executor restart and the call checks are the C++
client's; this class only names layers for Python and keeps the connection's device."""
import contextlib
from typing import Iterator, List, Optional, Union

import torch

from . import _C

# Raised for whatever the client or the executor refuses; the message names the problem (the
# executor's own words for an executor error). A RuntimeError.
Error = _C.Error
# The executor was lost while calls still waited for their results, and the client reconnected:
# redo the work since the last settle() (client_runtime/client.h, [Executor restart]). An Error.
ResultsLost = _C.ResultsLost
# One row of the executor's layer table: id, name, kind ('Linear' or 'Conv1D'), in_features,
# out_features, bias (whether the executor adds one), dtype (what the executor computes in).
LayerInfo = _C.LayerInfo


def model_hash(checkpoint: str) -> str:
    """The model hash of a checkpoint folder, as an executor serving it reports it (config.json and
    the weights' bytes; computed once, then cached beside the checkpoint). Pass it to
    Client.connect(expected_model_hash=...) to refuse an executor serving another model."""
    return _C.model_hash(checkpoint)


class Client:
    """A connection to a base executor. Make one with Client.connect(). Thread-safe: calls are
    serialized by the C++ client, and each call releases the GIL while it waits."""

    def __init__(self, native: "_C.Client", device: torch.device):
        self._native = native
        self.device = device
        self._layers = list(native.layers())
        self._by_name = {layer.name: layer for layer in self._layers}

    @staticmethod
    def connect(
        endpoint: str = "tcp://127.0.0.1:5555",
        *,
        tenant: str = "default",
        device: Union[str, torch.device] = "cpu",
        transport: str = "auto",
        expected_model_hash: str = "",
        timeout_ms: int = 60000,
        connect_timeout_ms: int = 10000,
        reconnect_ms: int = 60000,
        latency_class: str = "finetune",
        control: str = "auto",
        direct_operands: bool = True,
        spin_us: int = -1,
        executor_key: str = "",
        key_file: str = "",
        mask: bool = False,
        noise_ratio: float = 4.0,
        mask_secret: int = 0,
        mask_bank_rows: int = 256,
        mask_rotate_after: int = 0,
        mask_effects_checkpoint: str = "",
    ) -> "Client":
        """Handshakes with the executor at `endpoint` (its --listen) and fetches its layer table.

        device: where this tenant's tensors live ("cpu" or "cuda:N"); with transport "auto" it
        decides the transport (shm on the executor's host for a CPU tenant, cuda-ipc on the
        executor's GPU, nccl on another GPU, tcp from another host). expected_model_hash: refuse
        an executor serving another model ("" accepts any). latency_class: "finetune", "prefill"
        or "decode". mask: [Noise masking] (docs/privacy.md): activations and gradients reach the
        executor masked with noise only this process knows; noise_ratio, mask_secret,
        mask_bank_rows, mask_rotate_after and mask_effects_checkpoint are PrivacyOptions'
        noise_ratio, secret, bank_rows, rotate_after and effects_checkpoint
        (privacy/noise_mask.h). The other options are ClientOptions' (client_runtime/client.h).
        Raises symbiosis.Error naming the problem (unreachable executor, other model, bad option)."""
        try:
            device = torch.device(device)
        except RuntimeError:
            raise Error(f"client option device '{device}' should be cpu or cuda:N") from None
        native = _C.Client.connect(
            endpoint,
            tenant=tenant,
            device=str(device),
            transport=transport,
            expected_model_hash=expected_model_hash,
            timeout_ms=timeout_ms,
            connect_timeout_ms=connect_timeout_ms,
            reconnect_ms=reconnect_ms,
            latency_class=latency_class,
            control=control,
            direct_operands=direct_operands,
            spin_us=spin_us,
            executor_key=executor_key,
            key_file=key_file,
            mask=mask,
            noise_ratio=noise_ratio,
            mask_secret=mask_secret,
            mask_bank_rows=mask_bank_rows,
            mask_rotate_after=mask_rotate_after,
            mask_effects_checkpoint=mask_effects_checkpoint,
        )
        return Client(native, device)

    def layers(self) -> List[LayerInfo]:
        """The executor's layer table, in id order."""
        return list(self._layers)

    def layer(self, name: str) -> Optional[LayerInfo]:
        """The layer of this checkpoint name (without ".weight"), or None."""
        return self._by_name.get(name)

    def _layer_id(self, layer: Union[LayerInfo, str, int]) -> int:
        if isinstance(layer, str):
            info = self._by_name.get(layer)
            if info is None:
                raise Error(f"the executor serves no layer named '{layer}'")
            return info.id
        return layer if isinstance(layer, int) else layer.id

    def forward(self, layer: Union[LayerInfo, str, int], x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """x [tokens, in_features] (contiguous, the layer's dtype, on this client's device)
        -> x·Wᵀ + b [tokens, out_features], computed by the executor. No autograd: see
        symbiosis.virtualize for layers that take part in it."""
        return self._native.forward(self._layer_id(layer), x, with_bias)

    def backward_input(self, layer: Union[LayerInfo, str, int], grad_out: torch.Tensor) -> torch.Tensor:
        """grad_out [tokens, out_features] -> grad_out·W [tokens, in_features]."""
        return self._native.backward_input(self._layer_id(layer), grad_out)

    def settle(self) -> None:
        """Waits for every call made so far and raises the first executor error among them (a
        same-GPU client's calls may return before the executor answered: settle before an
        optimizer step)."""
        self._native.settle()

    def set_latency_class(self, latency_class: str) -> None:
        """"finetune", "prefill" or "decode": what this client's next calls carry."""
        self._native.set_latency_class(latency_class)

    @property
    def latency_class(self) -> str:
        return self._native.latency_class

    @contextlib.contextmanager
    def latency(self, latency_class: str) -> Iterator["Client"]:
        """Within, this client's calls carry `latency_class` ("decode" for generate(): the executor
        serves decode calls first, packed across tenants); the previous class after."""
        previous = self.latency_class
        self.set_latency_class(latency_class)
        try:
            yield self
        finally:
            self.set_latency_class(previous)

    @property
    def masked(self) -> bool:
        """Whether this client masks its calls with noise ([Noise masking], docs/privacy.md)."""
        return self._native.masked

    @property
    def model_hash(self) -> str:
        return self._native.model_hash

    @property
    def transport(self) -> str:
        """The transport in use: tcp, shm, cuda-ipc or nccl."""
        return self._native.transport

    @property
    def client_id(self) -> int:
        return self._native.client_id

    @property
    def calls(self) -> int:
        """Base-layer calls sent so far."""
        return self._native.calls

    def __deepcopy__(self, memo):
        return self  # a connection is shared, never copied (copy.deepcopy of a virtualized model)

    def __repr__(self) -> str:
        return (f"symbiosis.Client(transport={self.transport}, device={self.device}, "
                f"layers={len(self._layers)}, model_hash={self.model_hash[:12]})")
