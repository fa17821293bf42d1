#pragma once
// The client runtime in one include: connection, base layers, virtualization, model definitions,
// PEFT methods, training helpers and checkpoint loading.
#include "client_runtime/causal_lm.h"
#include "client_runtime/client.h"
#include "client_runtime/gpt2.h"
#include "client_runtime/llama.h"
#include "client_runtime/lora.h"
#include "client_runtime/model_io.h"
#include "client_runtime/nn.h"
#include "client_runtime/step_graph.h"
#include "client_runtime/training.h"
#include "client_runtime/virtualize.h"
