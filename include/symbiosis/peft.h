#pragma once
// Symbiosis client runtime, the PEFT methods: adapters a tenant trains on top of the frozen base,
// saved and loaded in Hugging Face PEFT's files (adapter_config.json + adapter_model.safetensors).
//  - layer-level, wrapping base layers: LoRA (rsLoRA, rank and alpha patterns; DoRA with
//    use_dora), AdaLoRA with its rank allocator, IA3: add_*, save_*, load_*;
//  - model-level, through a model's ModelAdapterHost: prompt tuning, P-tuning, prefix tuning;
//  - load_peft_adapter: whichever method a saved adapter's peft_type names.
#include "client_runtime/peft/adalora.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/peft/dora.h"
#include "client_runtime/peft/ia3.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/peft/model_adapter.h"
#include "client_runtime/peft/prompt.h"
