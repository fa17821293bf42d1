#pragma once
// Symbiosis client runtime, training: what turns a model with an adapter into a fine-tuning run.
//  - causal_lm_loss and token_cross_entropy: transformers' causal-LM loss (fused on a GPU);
//  - TokenDataset (JSON Lines of token ids) and its micro-batches, padded or packed;
//  - Trainer: gradient accumulation, warm-up and cosine schedule, clipping, evaluation and
//    checkpoints that resume exactly;
//  - FusedAdamW (one fused kernel per device and dtype) and StepGraph (a step captured in CUDA
//    graphs and replayed).
#include "client_runtime/training/dataset.h"
#include "client_runtime/training/fused_adamw.h"
#include "client_runtime/training/loss.h"
#include "client_runtime/training/step_graph.h"
#include "client_runtime/training/trainer.h"
