#pragma once
// What the harnesses share ([Fuzzing] in fuzz/CMakeLists.txt): an input split into the files an
// entry point reads, one scratch directory per process, and the harnesses' error contract.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace symbiosis {
class BaseModel;
}

namespace symbiosis::fuzz {

// Between the parts of a multi-file input (config.json, then model.safetensors, ...). Seed inputs
// are written with it (write_seeds below); the dictionaries name it so mutations keep it.
inline constexpr std::string_view kPartMarker = "\n#--part--#\n";

// The input's parts: at most `max_parts`, the last one holding the rest (markers and all).
std::vector<std::string_view> split_parts(const uint8_t* data, size_t size, size_t max_parts);

// A directory of this process's own (in /dev/shm where there is one), kept until it exits.
const std::filesystem::path& process_dir();
// A directory of this process's own, made empty at every call (in /dev/shm where there is one:
// the harnesses write their inputs as files many thousand times a second).
const std::filesystem::path& fresh_scratch_dir();
void write_file(const std::filesystem::path& path, std::string_view bytes);

// For the executor's harnesses: a base model of a few small layers (q, k, v in a group, an o_proj
// with bias), loaded once per process from a checkpoint written here. Every call it takes is at
// most kMaxRequestBytes.
const BaseModel& small_base_model();
inline constexpr uint64_t kMaxRequestBytes = 1 << 16;

// The seed corpus is written by the harnesses themselves, through the code's own writers
// (protobuf, write_safetensors, write_adapter): each harness defines write_seeds, which the replay
// program runs for --write-seeds DIR (docs/fuzzing.md).
void write_seeds(const std::filesystem::path& dir);
std::string join_parts(const std::vector<std::string>& parts);

// [Harness contract] The code under test refuses bad input with a c10::Error (TORCH_CHECK) whose
// message says what is wrong; anything else that escapes it (std::out_of_range, a JSON library's
// type_error, std::bad_alloc) is a finding: the harness aborts, naming the exception, so that
// libFuzzer keeps the input. `must_name`, when not empty, must appear in every refusal's message
// (a file's errors name the file).
template <typename Work>
void expect_refusal_or_success(Work&& work, const std::string& must_name = "") {
  try {
    work();
  } catch (const c10::Error& e) {
    if (!must_name.empty() && std::string(e.what()).find(must_name) == std::string::npos) {
      std::fprintf(stderr, "refusal does not name %s: %s\n", must_name.c_str(), e.what_without_backtrace());
      std::abort();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "not a refusal (c10::Error) but %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  }
}

// An invariant of the code under test that the harness checks; aborts naming it.
#define FUZZ_ASSERT(cond, ...)                                                          \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

}  // namespace symbiosis::fuzz
