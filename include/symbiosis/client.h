#pragma once
// Symbiosis client runtime, the connection: a tenant's link to a base executor.
//  - Client::connect(ClientOptions) handshakes with the executor, checks the model hash and fetches
//    the layer table; Client then computes base layers there (forward, backward_input) and
//    settle() waits for every call made so far, throwing the first executor error.
//  - virtualize() binds the base layers of any module tree (symbiosis::nn::Linear/Conv1D, or a
//    plain torch::nn::Linear) to the executor's layers of the same name, with no change to the
//    model's code.
// Model definitions are in <symbiosis/models.h>, PEFT methods in <symbiosis/peft.h>, training
// in <symbiosis/training.h>. Link Symbiosis::client (find_package(Symbiosis)).
#include "client_runtime/client.h"
#include "client_runtime/virtualize.h"
