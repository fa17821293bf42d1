// The client runtime's model definitions against transformers: tiny random checkpoints written by
// symbiosis-make-checkpoint (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Phi-3, GPT-2 also named as the Hub's, GPTBigCode,
// GPT-NeoX, Phi, OPT; Phi-3's longrope and OPT-350m's projections too) give the same
// logits (and loss) in our monolithic C++ models as in transformers' eager AutoModelForCausalLM; sharded and bf16 checkpoints load the same values; and
// the loader's errors name the tensor at fault.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <type_traits>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/gpt_neox.h"
#include "client_runtime/models/kv_cache.h"
#include "client_runtime/models/llama.h"
#include "client_runtime/models/model_io.h"
#include "client_runtime/training/loss.h"
#include "common/checkpoint.h"
#include "tests/python_reference.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;

const std::string kPython = SYMBIOSIS_PYTHON;
const fs::path kTool = fs::path(SYMBIOSIS_BINARY_DIR) / "tools" / "symbiosis-make-checkpoint";

struct Batch {
  at::Tensor input_ids;       // [B,T] int64
  at::Tensor attention_mask;  // [B,T] int64, row 1 right-padded
  at::Tensor labels;          // input_ids, -100 where padded
};

// left_padded: row 1's first three tokens are padding instead of its last three.
Batch make_batch(int64_t vocab, bool left_padded = false) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  Batch b;
  b.input_ids = at::randint(vocab, {2, 12}, gen, at::kLong);
  b.attention_mask = at::ones({2, 12}, at::kLong);
  using at::indexing::Slice;
  b.attention_mask.index_put_({1, left_padded ? Slice(0, 3) : Slice(9, at::indexing::None)}, 0);
  b.labels = b.input_ids.masked_fill(b.attention_mask == 0, kIgnoreIndex);
  return b;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

class HfReferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / ("symbiosis_hf_reference_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
    have_transformers_ =
        testing::run_reference("probe.py", {"transformers", "safetensors", "torch"}, *dir_ / "probe.log") == 0;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(*dir_, ec);
    delete dir_;
    dir_ = nullptr;
  }

  // A checkpoint directory made by the tool, once per (name, flags).
  static fs::path checkpoint(const std::string& name, const std::string& preset, const std::string& flags = "") {
    const fs::path out = *dir_ / name;
    if (!fs::exists(out / "config.json")) {
      const std::string cmd = "'" + kTool.string() + "' --preset " + preset + " --out '" + out.string() + "' " + flags +
                              " > '" + (*dir_ / (name + ".log")).string() + "' 2>&1";
      EXPECT_EQ(testing::shell(cmd), 0) << cmd;
    }
    return out;
  }

  // transformers' logits (and loss, given labels) for the batch.
  static std::pair<at::Tensor, at::Tensor> reference(const fs::path& ckpt, const Batch& batch) {
    const fs::path inputs = *dir_ / (ckpt.filename().string() + "_inputs.safetensors");
    const fs::path output = *dir_ / (ckpt.filename().string() + "_reference.safetensors");
    write_safetensors(inputs, {{"input_ids", batch.input_ids.to(at::kFloat)},
                               {"attention_mask", batch.attention_mask.to(at::kFloat)},
                               {"labels", batch.labels.to(at::kFloat)}});
    const fs::path log = *dir_ / (ckpt.filename().string() + "_reference.log");
    EXPECT_EQ(testing::run_reference(
                  "hf_logits.py",
                  {"--checkpoint", ckpt.string(), "--inputs", inputs.string(), "--output", output.string()}, log),
              0)
        << "see " << log;
    return {testing::read_safetensors_f32(output, "logits"), testing::read_safetensors_f32(output, "loss")};
  }

  void require_transformers() {
    if (!have_transformers_) GTEST_SKIP() << "the Python at " << kPython << " lacks transformers (or safetensors)";
  }

  // Our logits agree with transformers' within 1e-4 of the logits' scale; so does the loss.
  template <typename Model>
  void expect_matches_reference(Model model, const fs::path& ckpt, const Batch& batch = make_batch(256)) {
    auto [ref_logits, ref_loss] = reference(ckpt, batch);
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = model->forward(batch.input_ids, batch.attention_mask);
    }
    ASSERT_EQ(logits.sizes(), ref_logits.sizes());
    EXPECT_EQ(logits.scalar_type(), at::kFloat);
    const double scale = ref_logits.abs().max().item<double>();
    EXPECT_GT(scale, 0.1) << "reference logits are nearly zero: the test would prove little";
    const double diff = max_abs_diff(logits, ref_logits);
    std::cout << "  max |ours - transformers| = " << diff << " (logits' scale " << scale << ")\n";
    EXPECT_LE(diff, 1e-4 * scale) << ckpt;
    const double loss = causal_lm_loss(logits, batch.labels).item<double>();
    EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5 * std::abs(ref_loss.item<double>()));
  }

  // The logits of the batch from the checkpoint's model with its config changed by `change`.
  template <typename Config>
  static at::Tensor logits_with(const Config& config, const fs::path& ckpt,
                                const std::function<void(Config&)>& change) {
    auto changed = config;
    change(changed);
    typename std::conditional_t<std::is_same_v<Config, LlamaConfig>, LlamaForCausalLM, GPTNeoXForCausalLM> model(
        changed, /*materialize_base=*/false);
    load_weights(*model, *Checkpoint::open(ckpt));
    at::NoGradGuard no_grad;
    return model->forward(make_batch(256).input_ids);
  }

  // [Sliding window]: without its window the model computes other logits, from token `window` on
  // (before it, the window cuts nothing off), so matching transformers proves the window's effect.
  static void expect_window_matters(LlamaForCausalLM windowed, const fs::path& ckpt, int64_t window) {
    const auto expected = logits_with<LlamaConfig>(windowed->config(), ckpt, [](LlamaConfig&) {});
    const auto full = logits_with<LlamaConfig>(windowed->config(), ckpt, [](LlamaConfig& c) {
      c.sliding_window = 0;
      c.layer_types.clear();
    });
    EXPECT_TRUE(at::allclose(full.narrow(1, 0, window), expected.narrow(1, 0, window), 1e-5, 1e-6));
    EXPECT_GT(max_abs_diff(full, expected), 1e-3 * expected.abs().max().item<double>());
  }

  // A copy of checkpoint `source` (its single weights file) named `name`, config.json changed by `edit`.
  static auto with_config(const fs::path& source, const std::string& name,
                          const std::function<void(nlohmann::json&)>& edit) {
    const fs::path dir = *dir_ / name;
    fs::create_directories(dir);
    fs::copy_file(source / "model.safetensors", dir / "model.safetensors", fs::copy_options::overwrite_existing);
    auto config = nlohmann::json::parse(std::ifstream(source / "config.json"));
    edit(config);
    std::ofstream(dir / "config.json") << config.dump();
    return Checkpoint::open(dir);
  }

  // What Config::from_checkpoint says of such a copy.
  template <typename Config = LlamaConfig>
  static std::string refusal(const fs::path& source, const std::string& name,
                             const std::function<void(nlohmann::json&)>& edit) {
    const auto ckpt = with_config(source, name, edit);
    return testing::error_of([&] { Config::from_checkpoint(*ckpt); });
  }

  // Each setting, changed as `settings` says, changes the logits: matching transformers proves each.
  template <typename Config>
  static void expect_settings_matter(
      const Config& config, const fs::path& ckpt,
      const std::vector<std::pair<std::string, std::function<void(Config&)>>>& settings) {
    const at::Tensor expected = logits_with<Config>(config, ckpt, [](Config&) {});
    const double scale = expected.abs().max().item<double>();
    for (const auto& [name, change] : settings) {
      EXPECT_GT(max_abs_diff(logits_with<Config>(config, ckpt, change), expected), 1e-3 * scale)
          << name << " changes nothing";
    }
  }

  static fs::path* dir_;
  static bool have_transformers_;
};

fs::path* HfReferenceTest::dir_ = nullptr;
bool HfReferenceTest::have_transformers_ = false;

TEST_F(HfReferenceTest, TinyLlamaMatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-llama", "tiny-llama");
  auto model = load_llama(ckpt);
  EXPECT_EQ(model->config().rope_type, "llama3");
  EXPECT_FALSE(model->config().tie_word_embeddings);
  ASSERT_TRUE(model->lm_head);
  expect_matches_reference(model, ckpt);
}

TEST_F(HfReferenceTest, TinyLlamaTiedMatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-llama-tied", "tiny-llama-tied");
  auto model = load_llama(ckpt);
  EXPECT_TRUE(model->config().tie_word_embeddings);
  EXPECT_FALSE(model->lm_head);
  EXPECT_FALSE(model->named_parameters().contains("lm_head.weight"));
  expect_matches_reference(model, ckpt);
}

TEST_F(HfReferenceTest, TinyGPT2MatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-gpt2", "tiny-gpt2");
  auto model = load_gpt2(ckpt);
  expect_matches_reference(model, ckpt);
}

// [Checkpoint layouts]: tensors named as the Hub's GPT-2 checkpoints name them (h.0.attn.c_attn.weight,
// wte.weight, no lm_head) load into GPT2LMHeadModel and give transformers' logits.
TEST_F(HfReferenceTest, TinyGPT2HubLayoutMatchesTransformers) {
  require_transformers();
  const auto dir = checkpoint("tiny-gpt2-hub", "tiny-gpt2-hub");
  auto ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt->contains("h.0.attn.c_attn.weight"));
  EXPECT_TRUE(ckpt->contains("wte.weight"));
  EXPECT_FALSE(ckpt->contains("transformer.wte.weight"));
  EXPECT_FALSE(ckpt->contains("lm_head.weight"));
  GPT2LMHeadModel model(GPT2Config::from_checkpoint(*ckpt), /*materialize_base=*/false);
  EXPECT_EQ(checkpoint_names(*model, *ckpt).dropped_prefix, "transformer");
  EXPECT_EQ(checkpoint_names(*model, *ckpt).of("transformer.h.1.mlp.c_fc"), "h.1.mlp.c_fc");
  EXPECT_EQ(checkpoint_names(*model, *Checkpoint::open(checkpoint("tiny-gpt2", "tiny-gpt2"))).dropped_prefix, "");
  load_weights(*model, *ckpt);
  EXPECT_TRUE(at::equal(model->transformer->h->ptr<GPT2BlockImpl>(1)->attn->c_attn->weight,
                        ckpt->tensor("h.1.attn.c_attn.weight")));
  expect_matches_reference(model, dir);
}

// [GPT-2 family]: GPTBigCode (StarCoder) with multi-query attention, one key/value head, its c_attn a
// Linear layer giving q, k and v; and without multi_query, every head's q, k and v side by side.
TEST_F(HfReferenceTest, TinyGPTBigCodeMatchesTransformers) {
  require_transformers();
  const std::vector<std::pair<std::string, int64_t>> presets = {{"tiny-gpt-bigcode", 1}, {"tiny-gpt-bigcode-mha", 4}};
  for (const auto& [preset, kv_heads] : presets) {
    SCOPED_TRACE(preset);
    const auto ckpt = checkpoint(preset, preset);
    auto model = load_gpt2(ckpt);
    EXPECT_EQ(model->config().model_type, "gpt_bigcode");
    EXPECT_EQ(model->config().multi_query, kv_heads == 1);
    EXPECT_EQ(model->model_shape().model_type, "gpt_bigcode");
    EXPECT_EQ(model->model_shape().num_key_value_heads, kv_heads);
    const auto c_attn = model->transformer->h->ptr<GPT2BlockImpl>(0)->attn->c_attn;
    EXPECT_EQ(c_attn->kind(), LayerKind::kLinear);
    EXPECT_EQ(c_attn->weight.sizes(), at::IntArrayRef({64 + 2 * kv_heads * 16, 64}));  // [out, in]
    expect_matches_reference(model, ckpt);
  }
}

// [Llama family]: Qwen2, with biases on q, k and v (not o), tied like Qwen2-0.5B, its second layer
// attending over a sliding window of 5 (use_sliding_window from max_window_layers 1) shorter than
// the 12-token batch.
TEST_F(HfReferenceTest, TinyQwen2MatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-qwen2", "tiny-qwen2");
  auto model = load_llama(ckpt);
  EXPECT_EQ(model->config().model_type, "qwen2");
  EXPECT_EQ(model->model_shape().model_type, "qwen2");
  EXPECT_EQ(model->config().window_of(0), 0);
  EXPECT_EQ(model->config().window_of(1), 5);
  auto* attention = model->model->layers->ptr<LlamaDecoderLayerImpl>(0)->self_attn.get();
  EXPECT_TRUE(attention->q_proj->has_bias() && attention->k_proj->has_bias() && attention->v_proj->has_bias());
  EXPECT_FALSE(attention->o_proj->has_bias());
  EXPECT_FALSE(model->lm_head);
  expect_matches_reference(model, ckpt);
  expect_window_matters(model, ckpt, 5);
}

// [Qwen3]: each head's q and k RMS-normalized before the rotary embedding (the tenant's q_norm and
// k_norm), a head_dim (32) that is not hidden / heads, no biases, untied; its second layer attends
// over a sliding window of 5, as Qwen2's.
TEST_F(HfReferenceTest, TinyQwen3MatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-qwen3", "tiny-qwen3");
  auto model = load_llama(ckpt);
  EXPECT_EQ(model->config().model_type, "qwen3");
  EXPECT_EQ(model->config().resolved_head_dim(), 32);
  EXPECT_EQ(model->config().window_of(0), 0);
  EXPECT_EQ(model->config().window_of(1), 5);
  auto* attention = model->model->layers->ptr<LlamaDecoderLayerImpl>(0)->self_attn.get();
  ASSERT_TRUE(attention->q_norm && attention->k_norm);
  EXPECT_EQ(attention->q_norm->weight.sizes(), at::IntArrayRef({32}));
  EXPECT_FALSE(attention->q_proj->has_bias() || attention->o_proj->has_bias());
  EXPECT_TRUE(model->lm_head);
  expect_matches_reference(model, ckpt);
  expect_window_matters(model, ckpt, 5);
}

// [Llama family]: Mistral, every layer attending over a sliding window of 4, a third of the batch's
// 12 tokens.
TEST_F(HfReferenceTest, TinyMistralMatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-mistral", "tiny-mistral");
  auto model = load_llama(ckpt);
  EXPECT_EQ(model->config().model_type, "mistral");
  EXPECT_EQ(model->config().window_of(0), 4);
  EXPECT_EQ(model->config().window_of(1), 4);
  expect_matches_reference(model, ckpt);
  expect_window_matters(model, ckpt, 4);
}

// [Gemma 2] (a setting of [Llama family]): norms of 1 + weight on both sides of attention and of the
// MLP, GeGLU, embeddings scaled by sqrt(hidden), head_dim apart from hidden / heads, attention
// scores scaled by query_pre_attn_scalar^-1/2 and soft-capped, logits soft-capped, the head tied, a
// window of 4 in the even layer 0 and full attention in layer 1. Each of those settings is shown to
// change the logits, so matching transformers proves each.
TEST_F(HfReferenceTest, TinyGemma2MatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-gemma2", "tiny-gemma2");
  auto model = load_llama(ckpt);
  const auto& config = model->config();
  EXPECT_EQ(config.model_type, "gemma2");
  EXPECT_EQ(model->model_shape().model_type, "gemma2");
  EXPECT_EQ(config.window_of(0), 4);
  EXPECT_EQ(config.window_of(1), 0);
  EXPECT_EQ(config.resolved_head_dim(), 24);
  EXPECT_EQ(config.hidden_act, "gelu_pytorch_tanh");
  EXPECT_DOUBLE_EQ(config.attention_scores().scale, 0.5);
  EXPECT_DOUBLE_EQ(config.attention_scores().softcap, 0.1);
  EXPECT_DOUBLE_EQ(config.final_logit_softcapping, 0.5);
  EXPECT_FALSE(model->lm_head);
  const auto layer = model->model->layers->ptr<LlamaDecoderLayerImpl>(1);
  ASSERT_TRUE(layer->pre_feedforward_layernorm && layer->post_feedforward_layernorm);
  EXPECT_TRUE(at::equal(layer->post_feedforward_layernorm->weight,
                        Checkpoint::open(ckpt)->tensor("model.layers.1.post_feedforward_layernorm.weight")));
  expect_matches_reference(model, ckpt);
  expect_window_matters(model, ckpt, 4);
  expect_settings_matter<LlamaConfig>(
      config, ckpt,
      {{"query_pre_attn_scalar", [](LlamaConfig& c) { c.query_pre_attn_scalar = 0; }},
       {"attn_logit_softcapping", [](LlamaConfig& c) { c.attn_logit_softcapping = 0; }},
       {"final_logit_softcapping", [](LlamaConfig& c) { c.final_logit_softcapping = 0; }},
       {"scale_embeddings", [](LlamaConfig& c) { c.scale_embeddings = false; }}});
}

// [Phi-3]: q, k and v one base layer (qkv_proj), gate and up one (gate_up_proj), grouped-query
// attention split out of the fused output, RoPE over 12 of each head's 16 features (Phi-4-mini's
// partial_rotary_factor 0.75), every layer attending over a window of 5.
TEST_F(HfReferenceTest, TinyPhi3MatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-phi3", "tiny-phi3");
  auto model = load_llama(ckpt);
  const auto& config = model->config();
  EXPECT_EQ(config.model_type, "phi3");
  EXPECT_TRUE(config.fused_projections);
  EXPECT_EQ(config.rotary_dim(), 12);
  EXPECT_EQ(config.window_of(0), 5);
  EXPECT_EQ(config.window_of(1), 5);
  const auto layer = model->model->layers->ptr<LlamaDecoderLayerImpl>(0);
  ASSERT_TRUE(layer->self_attn->qkv_proj && layer->mlp->gate_up_proj);
  EXPECT_FALSE(layer->self_attn->q_proj || layer->self_attn->k_proj || layer->mlp->gate_proj || layer->mlp->up_proj);
  EXPECT_EQ(layer->self_attn->qkv_proj->weight.sizes(), at::IntArrayRef({64 + 2 * 32, 64}));
  EXPECT_EQ(layer->mlp->gate_up_proj->weight.sizes(), at::IntArrayRef({2 * 128, 64}));
  expect_matches_reference(model, ckpt);
  expect_window_matters(model, ckpt, 5);
  expect_settings_matter<LlamaConfig>(
      config, ckpt, {{"partial_rotary_factor", [](LlamaConfig& c) { c.partial_rotary_factor = 1.0; }}});
}

// [LongRoPE]: Phi-3-mini-128k's scaling over an original context of 8 positions. The 12-token batch
// passes it (the long factors), its first 8 tokens do not (the short ones): both equal transformers,
// and the long factors and the attention factor each change the logits.
TEST_F(HfReferenceTest, TinyPhi3LongRopeMatchesTransformersOnBothSidesOfItsOriginalContext) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-phi3-longrope", "tiny-phi3-longrope");
  auto model = load_llama(ckpt);
  const auto& config = model->config();
  EXPECT_EQ(config.rope_type, "longrope");
  EXPECT_EQ(config.rope_original_max_position_embeddings, 8);
  EXPECT_EQ(config.rope_long_factor.size(), 6u);
  EXPECT_DOUBLE_EQ(config.rope_attention_factor, std::sqrt(1 + std::log(32.0) / std::log(8.0)));
  const Batch batch = make_batch(256);
  expect_matches_reference(model, ckpt, batch);
  Batch within = {batch.input_ids.narrow(1, 0, 8), batch.attention_mask.narrow(1, 0, 8), batch.labels.narrow(1, 0, 8)};
  expect_matches_reference(model, ckpt, within);
  expect_settings_matter<LlamaConfig>(
      config, ckpt,
      {{"long_factor", [](LlamaConfig& c) { c.rope_long_factor = c.rope_short_factor; }},
       {"attention_factor", [](LlamaConfig& c) { c.rope_attention_factor = 1.0; }}});
}

// [LongRoPE] in cached steps ([Cached step]): each sequence takes the factors of the length it
// reaches, and one that crosses the original context in decode is recomputed, as transformers'
// generate recomputes it, so that every step's logits equal the uncached forward over the sequence
// so far (what transformers' generate gives): a prompt longer than the original context (long from
// its prefill on) and one that crosses it beside it, in packed steps and in a fixed-shape decode
// step with a padding row.
TEST_F(HfReferenceTest, TinyPhi3LongRopeCachedStepsEqualTheUncachedForward) {
  at::NoGradGuard no_grad;
  auto model = load_llama(checkpoint("tiny-phi3-longrope", "tiny-phi3-longrope"));
  auto ids = [](std::vector<int64_t> v) { return at::tensor(v, at::kLong); };
  auto expect_uncached = [&](const std::vector<int64_t>& sequence, const at::Tensor& row) {
    const auto uncached = model->forward(ids(sequence).unsqueeze(0))[0][-1];
    EXPECT_LT(max_abs_diff(row, uncached), 1e-5 * uncached.abs().max().item<double>()) << sequence.size() << " tokens";
  };
  auto step_logits = [&](const std::vector<int64_t>& tokens, const CachedStep& step) {
    return model->logits(model->forward_cached(model->embed(ids(tokens)).unsqueeze(0), step))[0];
  };
  KvCache cache(model->model_shape(), 2, 16, at::kFloat, at::kCPU, /*spare=*/1);
  std::vector<std::vector<int64_t>> sequences = {{5, 9, 33, 2, 7, 81, 14, 3, 60, 12}, {100, 4, 18}};
  std::vector<int64_t> packed = sequences[0];
  packed.insert(packed.end(), sequences[1].begin(), sequences[1].end());
  auto logits = step_logits(packed, CachedStep(cache, {{0, 0, 10}, {1, 0, 3}}));
  expect_uncached(sequences[0], logits[9]);
  expect_uncached(sequences[1], logits[12]);
  for (int64_t next = 11; next <= 16; ++next) {  // the second sequence decodes positions 3 .. 8: it crosses at 8
    const CachedStep decode(
        cache, {{0, static_cast<int64_t>(sequences[0].size()), 1}, {1, static_cast<int64_t>(sequences[1].size()), 1}});
    for (auto& s : sequences) s.push_back(next);
    logits = step_logits({next, next}, decode);
    expect_uncached(sequences[0], logits[0]);
    expect_uncached(sequences[1], logits[1]);
  }
  // A fixed-shape decode step ([Captured decode], run eagerly) in which a sequence crosses.
  KvCache fixed_cache(model->model_shape(), 2, 16, at::kFloat, at::kCPU, /*spare=*/1);
  const std::vector<int64_t> eight = {7, 1, 50, 3, 99, 20, 8, 41};
  step_logits(eight, CachedStep(fixed_cache, {{1, 0, 8}}));
  const auto step = CachedStep::fixed_decode(fixed_cache, ids({1, fixed_cache.spare_slot()}), ids({8, 0}));
  auto nine = eight;
  nine.push_back(13);
  expect_uncached(nine, step_logits({13, 0}, step)[0]);
}

// [LongRoPE] fields as transformers reads them: transformers 5's rope_parameters as transformers 4's
// rope_scaling, Phi-3's older "su" for longrope, the attention factor given or derived from
// max_position_embeddings / original; what is wrong or not Phi-3's is refused naming the field.
TEST_F(HfReferenceTest, LongRopeFieldsAreReadAndBadOnesNamed) {
  const auto source = checkpoint("tiny-phi3-longrope", "tiny-phi3-longrope");
  const auto v5 = LlamaConfig::from_checkpoint(*with_config(source, "longrope-v5", [](nlohmann::json& c) {
    auto rope = c["rope_scaling"];
    rope.erase("type");
    rope["rope_type"] = "longrope";
    rope["rope_theta"] = 500.0;
    rope["attention_factor"] = 1.25;
    c.erase("rope_scaling");
    c.erase("rope_theta");
    c["rope_parameters"] = rope;
  }));
  EXPECT_EQ(v5.rope_type, "longrope");
  EXPECT_DOUBLE_EQ(v5.rope_theta, 500.0);
  EXPECT_DOUBLE_EQ(v5.rope_attention_factor, 1.25);
  EXPECT_DOUBLE_EQ(v5.rope_long_factor[2], 2.25);
  const auto su = LlamaConfig::from_checkpoint(*with_config(source, "longrope-su", [](nlohmann::json& c) {
    c["rope_scaling"]["type"] = "su";
    c.erase("original_max_position_embeddings");  // Phi3Config's default, 4096
    c["max_position_embeddings"] = 4096 * 4;
  }));
  EXPECT_EQ(su.rope_type, "longrope");
  EXPECT_EQ(su.rope_original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(su.rope_attention_factor, std::sqrt(1 + std::log(4.0) / std::log(4096.0)));
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](nlohmann::json& c) { c["rope_scaling"]["short_factor"].erase(0); },
       "field 'rope_scaling.short_factor' has 5 numbers, expected 6"},
      {[](nlohmann::json& c) { c["rope_scaling"].erase("long_factor"); },
       "missing field 'rope_scaling.long_factor' (a list of 6 numbers)"},
      {[](nlohmann::json& c) { c["rope_scaling"]["long_factor"][1] = "x"; },
       "field 'rope_scaling.long_factor.1' should be a number"},
      {[](nlohmann::json& c) { c["original_max_position_embeddings"] = 0; },
       "field 'original_max_position_embeddings' is 0, expected a positive number of positions"},
      {[](nlohmann::json& c) { c["model_type"] = "mistral"; },
       "rope type 'longrope' is supported for Phi-3 (model_type 'phi3') only, not 'mistral'"},
      {[](nlohmann::json& c) { c["rope_scaling"]["type"] = "dynamic"; },
       "rope type 'dynamic' is not supported (expected 'default', 'llama3' or 'longrope')"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto message = refusal(source, "longrope-bad-" + std::to_string(i), cases[i].first);
    EXPECT_NE(message.find(cases[i].second), std::string::npos) << message;
  }
}

// [GPT-NeoX family]: GPT-NeoX (Pythia's shapes in small): RoPE over a quarter of each head, each
// head's q, k and v side by side in query_key_value, exact GELU, an untied embed_out; attention and
// MLP in parallel (use_parallel_residual) and in sequence.
TEST_F(HfReferenceTest, TinyGPTNeoXMatchesTransformers) {
  require_transformers();
  for (const std::string preset : {"tiny-gpt-neox", "tiny-gpt-neox-sequential"}) {
    SCOPED_TRACE(preset);
    const auto ckpt = checkpoint(preset, preset);
    auto model = load_gpt_neox(ckpt);
    const auto& config = model->config();
    EXPECT_EQ(config.model_type, "gpt_neox");
    EXPECT_EQ(config.parallel_residual, preset == "tiny-gpt-neox");
    EXPECT_EQ(config.rotary_dim(), 4);
    EXPECT_EQ(config.hidden_act, "gelu");
    const auto params = model->named_parameters();
    EXPECT_TRUE(params.contains("gpt_neox.layers.1.attention.query_key_value.bias"));
    EXPECT_TRUE(params.contains("gpt_neox.layers.1.mlp.dense_4h_to_h.weight"));
    EXPECT_TRUE(params.contains("embed_out.weight"));
    expect_matches_reference(model, ckpt);
    expect_settings_matter<GPTNeoXConfig>(
        config, ckpt,
        {{"partial_rotary_factor", [](GPTNeoXConfig& c) { c.partial_rotary_factor = 0.5; }},
         {"parallel_residual", [](GPTNeoXConfig& c) { c.parallel_residual = !c.parallel_residual; }},
         {"hidden_act", [](GPTNeoXConfig& c) { c.hidden_act = "relu"; }}});
  }
}

// [GPT-NeoX family]: Phi (phi-2's shapes in small): q, k and v of their own with biases and two
// key/value heads, attention and a gelu_new MLP in parallel from one layer norm, RoPE over half of
// each head, lm_head with a bias.
TEST_F(HfReferenceTest, TinyPhiMatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-phi", "tiny-phi");
  auto model = load_gpt_neox(ckpt);
  const auto& config = model->config();
  EXPECT_EQ(config.model_type, "phi");
  EXPECT_EQ(config.num_key_value_heads, 2);
  EXPECT_EQ(config.rotary_dim(), 8);
  EXPECT_EQ(model->model_shape().num_key_value_heads, 2);
  const auto params = model->named_parameters();
  EXPECT_TRUE(params.contains("model.layers.0.self_attn.dense.bias"));
  EXPECT_TRUE(params.contains("model.layers.0.mlp.fc1.weight"));
  EXPECT_TRUE(params.contains("model.final_layernorm.weight"));
  ASSERT_TRUE(model->head);
  EXPECT_TRUE(model->head->has_bias());
  EXPECT_FALSE(model->model->layers->ptr<GPTNeoXLayerImpl>(0)->mlp_norm);
  expect_matches_reference(model, ckpt);
  expect_settings_matter<GPTNeoXConfig>(
      config, ckpt, {{"partial_rotary_factor", [](GPTNeoXConfig& c) { c.partial_rotary_factor = 1.0; }}});
}

// [GPT-NeoX family]: OPT: learned positions offset by 2, counted over the mask's tokens (a
// left-padded row starts at position 0, as transformers counts it), ReLU, the head tied.
TEST_F(HfReferenceTest, TinyOPTMatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-opt", "tiny-opt");
  auto model = load_gpt_neox(ckpt);
  EXPECT_EQ(model->config().model_type, "opt");
  EXPECT_TRUE(model->config().learned_positions());
  EXPECT_FALSE(model->head);
  EXPECT_EQ(model->max_positions(), 128);
  const auto params = model->named_parameters();
  EXPECT_TRUE(params.contains("model.decoder.embed_positions.weight"));
  EXPECT_TRUE(params.contains("model.decoder.layers.1.fc2.bias"));
  EXPECT_TRUE(params.contains("model.decoder.layers.1.self_attn.out_proj.weight"));
  EXPECT_TRUE(params.contains("model.decoder.final_layer_norm.bias"));
  expect_matches_reference(model, ckpt);
  expect_matches_reference(model, ckpt, make_batch(256, /*left_padded=*/true));
}

// [OPT projections]: OPT-350m's shapes in small: token embeddings of 32 widened to the decoder's 64
// by project_in and narrowed back by project_out (base layers of their own, without biases), the
// norms after attention and after the MLP, no final norm; right- and left-padded batches.
TEST_F(HfReferenceTest, TinyOPTProjectedMatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-opt-projected", "tiny-opt-projected");
  auto model = load_gpt_neox(ckpt);
  const auto& config = model->config();
  EXPECT_EQ(config.embedding_width(), 32);
  EXPECT_TRUE(config.post_layer_norms);
  EXPECT_EQ(model->model_shape().hidden_size, 32);  // what virtual tokens take
  EXPECT_FALSE(model->model->final_norm);
  ASSERT_TRUE(model->model->project_in && model->model->project_out);
  EXPECT_FALSE(model->model->project_in->has_bias());
  EXPECT_EQ(model->model->project_in->weight.sizes(), at::IntArrayRef({64, 32}));
  const auto params = model->named_parameters();
  EXPECT_TRUE(params.contains("model.decoder.project_in.weight"));
  EXPECT_TRUE(params.contains("model.decoder.project_out.weight"));
  EXPECT_FALSE(params.contains("model.decoder.final_layer_norm.weight"));
  EXPECT_TRUE(params.contains("model.decoder.layers.1.final_layer_norm.weight"));
  expect_matches_reference(model, ckpt);
  expect_matches_reference(model, ckpt, make_batch(256, /*left_padded=*/true));
}

// What the [GPT-NeoX family] cannot compute is refused naming the field: OPT's bad embedding
// width, Phi's qk_layernorm, RoPE scaling.
TEST_F(HfReferenceTest, GPTNeoXFamilyRefusesWhatItCannotComputeNamingTheField) {
  const auto opt = checkpoint("tiny-opt", "tiny-opt");
  const auto phi = checkpoint("tiny-phi", "tiny-phi");
  const auto neox = checkpoint("tiny-gpt-neox", "tiny-gpt-neox");
  const std::vector<std::tuple<fs::path, std::string, std::function<void(nlohmann::json&)>, std::string>> cases = {
      {opt, "opt-projected-0", [](nlohmann::json& c) { c["word_embed_proj_dim"] = 0; },
       "field 'word_embed_proj_dim' is 0, expected a positive width"},
      {opt, "opt-gelu", [](nlohmann::json& c) { c["activation_function"] = "silu"; },
       "activation 'silu' is not supported (expected 'gelu', 'gelu_new' or 'relu')"},
      {phi, "phi-qk-norm", [](nlohmann::json& c) { c["qk_layernorm"] = true; }, "qk_layernorm=true is not supported"},
      {neox, "neox-scaled-rope",
       [](nlohmann::json& c) {
         c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
       },
       "rope type 'linear' is not supported (expected 'default')"},
      {neox, "neox-no-hidden", [](nlohmann::json& c) { c.erase("hidden_size"); }, "missing field 'hidden_size'"},
  };
  for (const auto& [source, name, edit, expected] : cases) {
    const auto message = refusal<GPTNeoXConfig>(source, name, edit);
    EXPECT_NE(message.find(expected), std::string::npos) << name << ": " << message;
  }
  // transformers 5's rope_parameters are read as transformers 4's fields are.
  const auto v5 = GPTNeoXConfig::from_checkpoint(*with_config(neox, "neox-rope-parameters", [](nlohmann::json& c) {
    c.erase("rotary_pct");
    c.erase("rotary_emb_base");
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500.0}, {"partial_rotary_factor", 0.5}};
  }));
  EXPECT_DOUBLE_EQ(v5.rope_theta, 500.0);
  EXPECT_EQ(v5.rotary_dim(), 8);
}

// [Gemma 2] settings read from config.json: transformers' defaults where a field is missing, null
// soft caps turn capping off, and what the client cannot compute is refused naming the field.
TEST_F(HfReferenceTest, Gemma2FieldsAreReadAndBadOnesNamed) {
  const auto source = checkpoint("tiny-gemma2", "tiny-gemma2");
  const auto defaults = LlamaConfig::from_checkpoint(*with_config(source, "gemma2-defaults", [](nlohmann::json& c) {
    for (const char* field : {"layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                              "query_pre_attn_scalar", "tie_word_embeddings"}) {
      c.erase(field);
    }
    c["num_hidden_layers"] = 3;
  }));
  EXPECT_EQ(defaults.window_of(0), 4);  // the even layers slide
  EXPECT_EQ(defaults.window_of(1), 0);
  EXPECT_EQ(defaults.window_of(2), 4);
  EXPECT_DOUBLE_EQ(defaults.attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(defaults.final_logit_softcapping, 30.0);
  EXPECT_DOUBLE_EQ(defaults.attention_scores().scale, 1.0 / 16.0);  // 256^-1/2
  EXPECT_TRUE(defaults.tie_word_embeddings);
  const auto uncapped = LlamaConfig::from_checkpoint(*with_config(source, "gemma2-uncapped", [](nlohmann::json& c) {
    c["attn_logit_softcapping"] = nullptr;
    c["final_logit_softcapping"] = nullptr;
  }));
  EXPECT_EQ(uncapped.attention_scores().softcap, 0.0);
  EXPECT_EQ(uncapped.final_logit_softcapping, 0.0);
  EXPECT_NE(refusal(source, "gemma2-relu", [](nlohmann::json& c) { c["hidden_activation"] = "relu"; })
                .find("hidden_activation 'relu' is not supported (expected 'gelu_pytorch_tanh')"),
            std::string::npos);
  EXPECT_NE(refusal(source, "gemma2-negative-cap", [](nlohmann::json& c) { c["final_logit_softcapping"] = -1.0; })
                .find("field 'final_logit_softcapping' is -1, expected a positive number or null"),
            std::string::npos);
  EXPECT_NE(refusal(source, "gemma2-bidirectional", [](nlohmann::json& c) { c["use_bidirectional_attention"] = true; })
                .find("use_bidirectional_attention=true is not supported"),
            std::string::npos);
}

// [Sliding window] settings read from config.json: bad ones are refused naming the field and what
// it takes; transformers 5's layer_types list is read as given.
TEST_F(HfReferenceTest, SlidingWindowFieldsAreReadAndBadOnesNamed) {
  const auto source = checkpoint("tiny-qwen2", "tiny-qwen2");
  const auto listed = LlamaConfig::from_checkpoint(*with_config(source, "qwen2-layer-types", [](nlohmann::json& c) {
    c["layer_types"] = {"sliding_attention", "full_attention"};
  }));
  EXPECT_EQ(listed.window_of(0), 5);
  EXPECT_EQ(listed.window_of(1), 0);
  const auto off = LlamaConfig::from_checkpoint(*with_config(source, "qwen2-no-window", [](nlohmann::json& c) {
    c["use_sliding_window"] = false;  // as Qwen2's own checkpoints: sliding_window set, but unused
  }));
  EXPECT_EQ(off.window_of(1), 0);
  EXPECT_NE(refusal(source, "qwen2-window-0", [](nlohmann::json& c) { c["sliding_window"] = 0; })
                .find("field 'sliding_window' is 0, expected a positive number of tokens or null"),
            std::string::npos);
  const auto chunked = [](nlohmann::json& c) { c["layer_types"] = {"full_attention", "chunked_attention"}; };
  EXPECT_NE(refusal(source, "qwen2-chunked", chunked)
                .find("field 'layer_types.1' is 'chunked_attention', expected 'full_attention' or 'sliding_attention'"),
            std::string::npos);
}

// An architecture the client has no model for is refused naming its model_type and the supported ones.
TEST_F(HfReferenceTest, UnsupportedModelTypeIsRefusedNamingItAndTheSupportedOnes) {
  const fs::path dir = *dir_ / "bloom";
  fs::create_directories(dir);
  write_safetensors(dir / "model.safetensors", {{"model.embed_tokens.weight", at::zeros({4, 2})}});
  std::ofstream(dir / "config.json") << R"({"model_type": "bloom"})";
  const auto message = testing::error_of([&] { open_causal_lm(*Checkpoint::open(dir)); });
  EXPECT_NE(message.find("model_type 'bloom' is not supported (supported: gemma2, gpt2, gpt_bigcode, gpt_neox, "
                         "llama, mistral, opt, phi, phi3, qwen2, qwen3)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find((dir / "config.json").string()), std::string::npos) << message;
}

// A model built without base weights gets them from load_weights and computes the same logits.
TEST_F(HfReferenceTest, UnmaterializedBaseLayersLoadTheSameWeights) {
  const auto ckpt_dir = checkpoint("tiny-llama", "tiny-llama");
  auto ckpt = Checkpoint::open(ckpt_dir);
  LlamaForCausalLM lazy(LlamaConfig::from_checkpoint(*ckpt), /*materialize_base=*/false);
  auto* q_proj = lazy->model->layers->ptr<LlamaDecoderLayerImpl>(0)->self_attn->q_proj.get();
  EXPECT_FALSE(q_proj->weight.defined());
  EXPECT_FALSE(lazy->lm_head->weight.defined());
  load_weights(*lazy, *ckpt);
  ASSERT_TRUE(q_proj->weight.defined());
  EXPECT_TRUE(at::equal(q_proj->weight, ckpt->tensor("model.layers.0.self_attn.q_proj.weight")));
  auto eager = load_llama(ckpt_dir);
  const Batch batch = make_batch(256);
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(lazy->forward(batch.input_ids), eager->forward(batch.input_ids)));
}

TEST_F(HfReferenceTest, ShardedCheckpointLoadsTheSameValues) {
  const auto single = checkpoint("tiny-llama", "tiny-llama");
  const auto sharded = checkpoint("tiny-llama-sharded", "tiny-llama", "--shard-size 100000");
  ASSERT_TRUE(fs::exists(sharded / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(sharded)) shards += e.path().extension() == ".safetensors";
  EXPECT_GE(shards, 3);
  EXPECT_TRUE(fs::exists(sharded / ("model-00001-of-0000" + std::to_string(shards) + ".safetensors")));
  auto a = Checkpoint::open(single), b = Checkpoint::open(sharded);
  EXPECT_EQ(a->names(), b->names());
  const Batch batch = make_batch(256);
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(load_llama(single)->forward(batch.input_ids, batch.attention_mask),
                        load_llama(sharded)->forward(batch.input_ids, batch.attention_mask)));
}

TEST_F(HfReferenceTest, ShardedGPT2MatchesTransformers) {
  require_transformers();
  const auto ckpt = checkpoint("tiny-gpt2-sharded", "tiny-gpt2", "--shard-size 60000");
  ASSERT_TRUE(fs::exists(ckpt / "model.safetensors.index.json"));
  expect_matches_reference(load_gpt2(ckpt), ckpt);
}

// bf16 weights are the fp32 ones rounded: loaded into an fp32 model they give exactly the logits
// of the fp32 model with rounded weights; run in bf16 they stay close to fp32.
TEST_F(HfReferenceTest, Bf16CheckpointHoldsRoundedFp32Weights) {
  const auto fp32_dir = checkpoint("tiny-llama", "tiny-llama");
  const auto bf16_dir = checkpoint("tiny-llama-bf16", "tiny-llama", "--dtype bf16");
  auto bf16_ckpt = Checkpoint::open(bf16_dir);
  EXPECT_EQ(bf16_ckpt->record("model.embed_tokens.weight").dtype, at::kBFloat16);
  EXPECT_EQ(bf16_ckpt->config_string("torch_dtype"), "bfloat16");

  auto rounded = load_llama(fp32_dir);
  {
    at::NoGradGuard no_grad;
    for (auto& p : rounded->parameters()) p.copy_(p.to(at::kBFloat16).to(at::kFloat));
  }
  auto from_bf16 = load_llama(bf16_dir);  // fp32 model
  auto exact = load_llama(fp32_dir);
  auto in_bf16 = load_llama(bf16_dir, true, at::kBFloat16);
  EXPECT_EQ(in_bf16->model->embed_tokens->weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(in_bf16->model->layers->ptr<LlamaDecoderLayerImpl>(1)->mlp->down_proj->weight.scalar_type(), at::kBFloat16);

  const Batch batch = make_batch(256);
  at::NoGradGuard no_grad;
  auto reference = exact->forward(batch.input_ids, batch.attention_mask);
  auto from_bf16_logits = from_bf16->forward(batch.input_ids, batch.attention_mask);
  EXPECT_TRUE(at::equal(from_bf16_logits, rounded->forward(batch.input_ids, batch.attention_mask)));
  const double scale = reference.abs().max().item<double>();
  EXPECT_GT(max_abs_diff(from_bf16_logits, reference), 0.0) << "bf16 weights should differ from fp32 ones";
  EXPECT_LE(max_abs_diff(from_bf16_logits, reference), 2e-2 * scale);
  EXPECT_LE(max_abs_diff(in_bf16->forward(batch.input_ids, batch.attention_mask), reference), 5e-2 * scale);
}

TEST_F(HfReferenceTest, MissingTensorIsNamed) {
  auto ckpt = Checkpoint::open(checkpoint("tiny-llama", "tiny-llama"));
  auto config = LlamaConfig::from_checkpoint(*ckpt);
  config.num_hidden_layers = 3;
  LlamaForCausalLM model(config, false);
  try {
    load_weights(*model, *ckpt);
    FAIL() << "loading a 3-layer model from a 2-layer checkpoint should fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor 'model.layers.2."), std::string::npos) << e.what();
  }
}

TEST_F(HfReferenceTest, ExtraTensorIsNamed) {
  auto ckpt = Checkpoint::open(checkpoint("tiny-llama", "tiny-llama"));
  auto config = LlamaConfig::from_checkpoint(*ckpt);
  config.num_hidden_layers = 1;
  LlamaForCausalLM model(config, false);
  try {
    load_weights(*model, *ckpt);
    FAIL() << "loading a 1-layer model from a 2-layer checkpoint should fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has tensor 'model.layers.1."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not use"), std::string::npos) << e.what();
  }
}

TEST_F(HfReferenceTest, UntiedHeadIntoTiedModelIsRefused) {
  auto ckpt = Checkpoint::open(checkpoint("tiny-llama", "tiny-llama"));
  auto config = LlamaConfig::from_checkpoint(*ckpt);
  config.tie_word_embeddings = true;
  LlamaForCausalLM model(config, false);
  try {
    load_weights(*model, *ckpt);
    FAIL() << "an untied lm_head should not be dropped silently";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'lm_head.weight'"), std::string::npos) << e.what();
  }
}

TEST_F(HfReferenceTest, WrongShapeIsNamed) {
  auto ckpt = Checkpoint::open(checkpoint("tiny-gpt2", "tiny-gpt2"));
  auto config = GPT2Config::from_checkpoint(*ckpt);
  config.n_inner = 3 * config.n_embd;
  GPT2LMHeadModel model(config, true);
  try {
    load_weights(*model, *ckpt);
    FAIL() << "a wrong n_inner should fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'transformer.h.0.mlp.c_fc.weight' has shape"), std::string::npos)
        << e.what();
  }
}

TEST_F(HfReferenceTest, ToolRefusesUnknownPreset) {
  const fs::path out = *dir_ / "unknown";
  EXPECT_NE(
      testing::shell("'" + kTool.string() + "' --preset llama-9000 --out '" + out.string() + "' > /dev/null 2>&1"), 0);
  EXPECT_FALSE(fs::exists(out / "config.json"));
}

// The real presets' shapes, cut to one layer: the configs parse and the tensor table matches the
// model that reads it (no missing or extra tensor), without writing gigabytes.
TEST_F(HfReferenceTest, RealPresetsMatchTheirModels) {
  for (const std::string preset : {"gpt2-xl", "llama-3.2-1b"}) {
    SCOPED_TRACE(preset);
    const auto dir = checkpoint(preset + "-1layer", preset, "--layers 1 --dtype bf16");
    auto ckpt = Checkpoint::open(dir);
    if (preset == "gpt2-xl") {
      GPT2LMHeadModel model(GPT2Config::from_checkpoint(*ckpt), /*materialize_base=*/false);
      EXPECT_EQ(model->config().n_embd, 1600);
      EXPECT_NO_THROW(load_weights(*model, *ckpt));
    } else {
      LlamaForCausalLM model(LlamaConfig::from_checkpoint(*ckpt), /*materialize_base=*/false);
      EXPECT_NO_THROW(load_weights(*model, *ckpt));
      if (preset == "llama-3.2-1b") {
        EXPECT_EQ(model->config().num_key_value_heads, 8);
        EXPECT_EQ(model->config().rope_type, "llama3");
        EXPECT_TRUE(model->config().tie_word_embeddings);
      }
    }
  }
}

// tiny-llama's RoPE (head_dim 16, theta 1e4, llama3 factor 8, bands at wavelengths 8 and 32) has
// frequencies in all three bands, so the transformers comparison above covers each of them.
TEST(LlamaRopeTest, Llama3ScalingFollowsTheThreeBands) {
  LlamaConfig config;
  config.hidden_size = 64;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.rope_theta = 10000.0;
  const auto base = detail::llama_inv_freq(config);
  config.rope_type = "llama3";
  config.rope_factor = 8.0;
  config.rope_low_freq_factor = 1.0;
  config.rope_high_freq_factor = 4.0;
  config.rope_original_max_position_embeddings = 32;
  const auto scaled = detail::llama_inv_freq(config);
  ASSERT_EQ(scaled.numel(), 8);
  // Wavelength 2*pi*1e4^(i/8): i=0 (6.3) is short, kept; i=1 (19.9) is between, smoothed;
  // i>=2 (>= 62.8) is long, divided by the factor.
  EXPECT_FLOAT_EQ(scaled[0].item<float>(), base[0].item<float>());
  const double f1 = base[1].item<double>();
  const double smooth = (32.0 * f1 / (2 * M_PI) - 1.0) / 3.0;
  EXPECT_NEAR(scaled[1].item<double>(), (1 - smooth) * f1 / 8.0 + smooth * f1, 1e-6 * f1);
  EXPECT_NE(scaled[1].item<float>(), base[1].item<float>());
  for (int64_t i = 2; i < 8; ++i) EXPECT_FLOAT_EQ(scaled[i].item<float>(), base[i].item<float>() / 8.0f) << i;
}

// The fused RoPE node gives what autograd gives for the same expression left to it, in value and
// in gradient, for a non-contiguous x (q and k are transposed views) and cos/sin broadcast over heads.
TEST(LlamaRopeTest, FusedRotaryMatchesAutogradOfTheExpression) {
  at::manual_seed(3);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const auto x0 = at::randn({2, 5, 3, 8}, opts).transpose(1, 2);  // [batch, heads, tokens, head_dim]
  const auto cos = at::randn({2, 1, 5, 8}, opts), sin = at::randn({2, 1, 5, 8}, opts);
  const auto upstream = at::randn({2, 3, 5, 8}, opts);
  auto fused_x = x0.detach().requires_grad_(true);
  auto fused = detail::apply_rotary(fused_x, cos, sin);
  fused.backward(upstream);
  auto plain_x = x0.detach().requires_grad_(true);
  auto rotated = at::cat({-plain_x.narrow(-1, 4, 4), plain_x.narrow(-1, 0, 4)}, -1);
  auto plain = plain_x * cos + rotated * sin;
  plain.backward(upstream);
  EXPECT_TRUE(at::allclose(fused, plain, 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(fused_x.grad(), plain_x.grad(), 1e-12, 1e-12));
  EXPECT_GT(fused_x.grad().abs().sum().item<double>(), 0.0);
  {
    at::NoGradGuard no_grad;  // without a gradient, the plain expression
    EXPECT_TRUE(at::allclose(detail::apply_rotary(x0, cos, sin), plain, 1e-12, 1e-12));
  }
}

TEST(CausalLmLossTest, ShiftsAndIgnores) {
  // Two positions predict; the second label is ignored, so the loss is the first prediction's.
  auto logits = at::zeros({1, 3, 4});
  logits.index_put_({0, 0, 2}, 5.0);
  auto labels = at::tensor({int64_t{7}, int64_t{2}, kIgnoreIndex}, at::kLong).view({1, 3});
  const double expected = -at::log_softmax(logits[0][0], 0)[2].item<double>();
  EXPECT_NEAR(causal_lm_loss(logits, labels).item<double>(), expected, 1e-6);
}

}  // namespace
}  // namespace symbiosis
