// Reading Hugging Face checkpoints: dtypes, shards, memory mapping, and an error naming the file
// and the problem for each kind of bad checkpoint.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/checkpoint.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

void write_config(const fs::path& dir,
                  const std::string& text = R"({"model_type": "llama", "rope_scaling": {"factor": 8.0}})") {
  std::ofstream(dir / "config.json") << text;
}

TEST(CheckpointTest, ReadsEveryDtypeAndTheConfig) {
  auto dir = testing::temp_dir("ckpt");
  write_config(dir);
  auto a = at::randn({3, 5});
  write_safetensors(dir / "model.safetensors", {{"a", a}, {"b", a.to(at::kBFloat16)}, {"c", a.to(at::kHalf)}});
  auto ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt->tensor("a", {3, 5}).equal(a));
  EXPECT_TRUE(ckpt->tensor("b").equal(a.to(at::kBFloat16)));
  EXPECT_TRUE(ckpt->tensor("c").equal(a.to(at::kHalf)));
  EXPECT_EQ(ckpt->record("b").dtype, at::kBFloat16);
  EXPECT_EQ(ckpt->config_string("model_type"), "llama");
  EXPECT_EQ(ckpt->config_number("rope_scaling.factor"), 8.0);
  EXPECT_FALSE(ckpt->config_number("rope_scaling.missing").has_value());
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"a", "b", "c"}));
}

TEST(CheckpointTest, ReadsShardsThroughTheIndex) {
  auto dir = testing::temp_dir("ckpt");
  write_config(dir);
  auto a = at::randn({4}), b = at::randn({2, 2});
  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"a", a}});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {{"b", b}});
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})";
  auto ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt->tensor("a").equal(a));
  EXPECT_TRUE(ckpt->tensor("b").equal(b));
}

TEST(CheckpointTest, TensorsAreMappedNotCopiedAndWritesStayPrivate) {
  auto dir = testing::temp_dir("ckpt");
  write_config(dir);
  write_safetensors(dir / "model.safetensors", {{"a", at::ones({1024})}});
  {
    auto ckpt = Checkpoint::open(dir);
    auto t1 = ckpt->tensor("a");
    auto t2 = ckpt->tensor("a");
    EXPECT_EQ(t1.data_ptr(), t2.data_ptr());  // both views of the one mapping
    t1.fill_(5);                              // copy-on-write: the file is untouched
  }
  EXPECT_TRUE(Checkpoint::open(dir)->tensor("a").equal(at::ones({1024})));
}

TEST(CheckpointTest, ModelHashIdentifiesConfigAndTensorTable) {
  auto dir1 = testing::temp_dir("ckpt"), dir2 = testing::temp_dir("ckpt");
  write_config(dir1);
  write_config(dir2);
  write_safetensors(dir1 / "model.safetensors", {{"a", at::zeros({2, 3})}});
  write_safetensors(dir2 / "model.safetensors", {{"a", at::zeros({3, 2})}});
  EXPECT_NE(Checkpoint::open(dir1)->model_hash(), Checkpoint::open(dir2)->model_hash());
  EXPECT_EQ(Checkpoint::open(dir1)->model_hash(), Checkpoint::open(dir1)->model_hash());
}

// [Weight hash]: a fine-tuned base of the same shape is another model.
TEST(CheckpointTest, ModelHashCoversTheWeightsBytes) {
  auto base = testing::temp_dir("ckpt"), tuned = testing::temp_dir("ckpt"), sharded = testing::temp_dir("ckpt");
  for (const auto& dir : {base, tuned, sharded}) write_config(dir);
  const auto a = at::randn({2, 3}), b = at::randn({4});
  write_safetensors(base / "model.safetensors", {{"a", a}, {"b", b}});
  auto a_tuned = a.clone();
  a_tuned[1][2] += 1e-3;  // one weight differs
  write_safetensors(tuned / "model.safetensors", {{"a", a_tuned}, {"b", b}});
  EXPECT_NE(Checkpoint::open(base)->model_hash(), Checkpoint::open(tuned)->model_hash());
  // The same tensors spread over shards in another order are the same model.
  write_safetensors(sharded / "model-00001-of-00002.safetensors", {{"b", b}});
  write_safetensors(sharded / "model-00002-of-00002.safetensors", {{"a", a}});
  std::ofstream(sharded / "model.safetensors.index.json")
      << R"({"weight_map": {"b": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"}})";
  EXPECT_EQ(Checkpoint::open(sharded)->model_hash(), Checkpoint::open(base)->model_hash());
}

// The digests the hash is made of are cached beside the checkpoint: a second open reads the cache,
// not the weights, and a weight file that changed is hashed again.
TEST(CheckpointTest, WeightDigestsAreCachedAndRecomputedWhenAFileChanges) {
  auto dir = testing::temp_dir("ckpt");
  write_config(dir);
  const auto a = at::randn({8, 8});
  write_safetensors(dir / "model.safetensors", {{"a", a}});
  const std::string hash = Checkpoint::open(dir)->model_hash();
  const auto cache_file = dir / ".symbiosis-model-hash.json";
  ASSERT_TRUE(fs::exists(cache_file));
  auto read_json = [](const fs::path& file) {
    std::ifstream in(file);
    return nlohmann::json::parse(in);
  };
  auto cache = read_json(cache_file);
  ASSERT_TRUE(cache["files"]["model.safetensors"]["tensors"].contains("a")) << cache.dump();

  // A cached digest changed by hand changes the hash: the second open used the cache.
  cache["files"]["model.safetensors"]["tensors"]["a"] = std::string(64, '0');
  std::ofstream(cache_file) << cache.dump();
  EXPECT_NE(Checkpoint::open(dir)->model_hash(), hash);

  // Rewriting the weight file (the same bytes) invalidates its entry: hashed again, as before.
  write_safetensors(dir / "model.safetensors", {{"a", a}});
  EXPECT_EQ(Checkpoint::open(dir)->model_hash(), hash);
  EXPECT_NE(read_json(cache_file)["files"]["model.safetensors"]["tensors"]["a"], std::string(64, '0'));
  // Other bytes of the same shape: another hash.
  write_safetensors(dir / "model.safetensors", {{"a", a + 1}});
  EXPECT_NE(Checkpoint::open(dir)->model_hash(), hash);
  // A damaged cache is only recomputed.
  std::ofstream(cache_file) << "{ not json";
  write_safetensors(dir / "model.safetensors", {{"a", a}});
  EXPECT_EQ(Checkpoint::open(dir)->model_hash(), hash);
}

// Where the checkpoint's directory takes no cache (here a directory stands in the cache file's
// place, which even root cannot write over), the cache lies in $XDG_CACHE_HOME/symbiosis/.
TEST(CheckpointTest, DigestsGoToTheUsersCacheWhenTheCheckpointTakesNone) {
  auto dir = testing::temp_dir("ckpt"), cache_home = testing::temp_dir("xdg");
  write_config(dir);
  write_safetensors(dir / "model.safetensors", {{"a", at::randn({3})}});
  fs::create_directory(dir / ".symbiosis-model-hash.json");
  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  ::setenv("XDG_CACHE_HOME", cache_home.c_str(), 1);
  const std::string hash = Checkpoint::open(dir)->model_hash();
  const auto user_cache = cache_home / "symbiosis" / "model-hash";
  ASSERT_TRUE(fs::is_directory(user_cache));
  std::vector<fs::path> files;
  for (const auto& f : fs::directory_iterator(user_cache)) files.push_back(f.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].extension(), ".json");
  EXPECT_EQ(Checkpoint::open(dir)->model_hash(), hash);
  if (old) {
    ::setenv("XDG_CACHE_HOME", saved.c_str(), 1);
  } else {
    ::unsetenv("XDG_CACHE_HOME");
  }
}

TEST(CheckpointTest, ErrorsNameTheFileAndTheProblem) {
  auto dir = testing::temp_dir("ckpt");
  EXPECT_NE(error_of([&] { Checkpoint::open(dir / "nope"); }).find("does not exist"), std::string::npos);
  EXPECT_NE(error_of([&] { Checkpoint::open(dir); }).find("missing file \"" + (dir / "config.json").string()),
            std::string::npos);
  write_config(dir, "{ not json");
  EXPECT_NE(error_of([&] { Checkpoint::open(dir); }).find("bad JSON in \"" + (dir / "config.json").string()),
            std::string::npos);
  write_config(dir);
  EXPECT_NE(error_of([&] { Checkpoint::open(dir); }).find("model.safetensors"), std::string::npos);

  write_safetensors(dir / "model.safetensors", {{"w", at::zeros({2, 3})}});
  auto ckpt = Checkpoint::open(dir);
  EXPECT_NE(error_of([&] { ckpt->tensor("missing"); }).find("is missing tensor 'missing'"), std::string::npos);
  EXPECT_NE(error_of([&] {
              ckpt->tensor("w", {3, 2});
            }).find("tensor 'w' has shape [2, 3], expected [3, 2]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ckpt->config_number("model_type"); }).find("field 'model_type' should be a number"),
            std::string::npos);

  // An integer tensor: a dtype this project does not serve.
  const std::string header = R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})";
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  uint64_t len = header.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header << std::string(8, '\0');
  out.close();
  EXPECT_NE(error_of([&] { Checkpoint::open(dir); }).find("tensor 'w': unsupported dtype 'I64'"), std::string::npos);

  std::ofstream(dir / "model.safetensors", std::ios::binary) << "tiny";
  EXPECT_NE(error_of([&] { Checkpoint::open(dir); }).find("too short to be safetensors"), std::string::npos);
}

}  // namespace
}  // namespace symbiosis

namespace symbiosis {
namespace {

// A safetensors file of one header (the JSON text as given) and `data_bytes` zero bytes.
void write_raw_safetensors(const fs::path& file, const std::string& header, size_t data_bytes) {
  std::ofstream out(file, std::ios::binary);
  const uint64_t len = header.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header << std::string(data_bytes, '\0');
}

// [Fuzzing] (docs/fuzzing.md; inputs in fuzz/regressions/checkpoint/): numbers in a header that overflow a sum or a
// product, entries of the wrong JSON type, and shards outside the folder are refused naming the
// file and the tensor, never read past the file or thrown as another exception.
// A safetensors header is a map: a tensor listed twice would leave one of its two data ranges
// unnamed, so the writer refuses it, naming the tensor (and writes nothing past the refusal).
TEST(CheckpointTest, WritingATensorListedTwiceIsRefusedNamingIt) {
  auto dir = testing::temp_dir("ckpt");
  EXPECT_NE(error_of([&] {
              write_safetensors(dir / "model.safetensors", {{"w", at::zeros({2})}, {"w", at::ones({2})}});
            }).find("tensor 'w' listed twice"),
            std::string::npos);
}

TEST(CheckpointTest, HostileHeadersAndIndexesAreRefusedNamingTheFile) {
  auto dir = testing::temp_dir("ckpt-hostile");
  write_config(dir);
  auto refusal = [&](const std::string& header) {
    write_raw_safetensors(dir / "model.safetensors", header, 16);
    return error_of([&] { Checkpoint::open(dir); });
  };
  const std::string file = (dir / "model.safetensors").string();
  // An end offset that wraps the file's start to a small number.
  auto message = refusal(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 18446744073709551615]}})");
  EXPECT_NE(message.find(file + ", tensor 'w': bad data_offsets"), std::string::npos) << message;
  // A shape whose product overflows to the 16 bytes there are.
  message = refusal(R"({"w": {"dtype": "F32", "shape": [4611686018427387905, 4], "data_offsets": [0, 16]}})");
  EXPECT_NE(message.find("tensor 'w': shape"), std::string::npos) << message;
  EXPECT_NE(message.find("does not fit the file"), std::string::npos) << message;
  message = refusal(R"({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})");
  EXPECT_NE(message.find("does not fit the file"), std::string::npos) << message;
  message = refusal(R"({"w": {"dtype": 7, "shape": [4], "data_offsets": [0, 16]}})");
  EXPECT_NE(message.find(file + ", tensor 'w': dtype should be a string"), std::string::npos) << message;
  message = refusal(R"([1, 2])");
  EXPECT_NE(message.find("bad JSON header in \"" + file + "\": expected an object"), std::string::npos) << message;

  write_safetensors(dir / "model.safetensors", {{"w", at::zeros({2})}});
  const auto index = dir / "model.safetensors.index.json";
  for (const std::string shard : {"../model.safetensors", "/etc/passwd", "..", "7"}) {
    nlohmann::json j = {{"weight_map", {{"w", shard == "7" ? nlohmann::json(7) : nlohmann::json(shard)}}}};
    std::ofstream(index) << j.dump();
    message = error_of([&] { Checkpoint::open(dir); });
    EXPECT_NE(message.find("tensor 'w' is in"), std::string::npos) << shard << ": " << message;
    EXPECT_NE(message.find("expected the name of a file in the checkpoint's folder"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace symbiosis
