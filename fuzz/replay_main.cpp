// [Fuzzing] The replay program: a harness's LLVMFuzzerTestOneInput, run without libFuzzer (in the
// ordinary gcc build) over given inputs, so that make test smokes every harness without clang:
//   fuzz_replay_<name> [--mutations N] [--seed S] PATH...  every file (of each folder) once, then
//       N mutations of each (bytes flipped, inserted, erased, repeated; inputs spliced; a fixed
//       pseudo-random sequence, so a failure repeats);
//   fuzz_replay_<name> --write-seeds DIR  writes the harness's seed inputs (fuzz/corpus/<name>/).
// A finding aborts, as under libFuzzer; the input is written to ./crash-replay-<n> first.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv);  // fuzz_support.cpp

namespace fs = std::filesystem;

namespace {

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string mutate(std::string input, const std::vector<std::string>& inputs, std::mt19937_64& random) {
  auto pick = [&](size_t n) { return n == 0 ? 0 : static_cast<size_t>(random() % n); };
  const int edits = 1 + static_cast<int>(random() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (random() % 6) {
      case 0:  // flip a bit
        if (!input.empty()) input[pick(input.size())] ^= static_cast<char>(1u << (random() % 8));
        break;
      case 1:  // an interesting byte
        if (!input.empty()) {
          const char values[] = {0, 1, 0x7f, static_cast<char>(0x80), static_cast<char>(0xff), '-', '9', '"'};
          input[pick(input.size())] = values[random() % sizeof values];
        }
        break;
      case 2:  // insert bytes
        input.insert(pick(input.size() + 1), std::string(1 + random() % 8, static_cast<char>(random())));
        break;
      case 3:  // erase a run
        if (!input.empty()) {
          const size_t at = pick(input.size());
          input.erase(at, 1 + pick(std::min<size_t>(16, input.size() - at)));
        }
        break;
      case 4:  // truncate
        input.resize(pick(input.size() + 1));
        break;
      default: {  // splice in a run of another input
        const auto& other = inputs[pick(inputs.size())];
        if (other.empty()) break;
        const size_t from = pick(other.size());
        input.insert(pick(input.size() + 1), other.substr(from, 1 + pick(std::min<size_t>(64, other.size() - from))));
      }
    }
  }
  return input;
}

int crashes_written = 0;
void run(const std::string& input) {
  // Kept on disk until the input has passed, so that an abort leaves it behind.
  const std::string path = "crash-replay-" + std::to_string(crashes_written);
  { std::ofstream(path, std::ios::binary) << input; }
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  fs::remove(path);
}

}  // namespace

int main(int argc, char** argv) {
  LLVMFuzzerInitialize(&argc, &argv);
  size_t mutations = 0;
  uint64_t seed = 1;
  std::vector<fs::path> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--mutations" && i + 1 < argc) {
      mutations = std::stoul(argv[++i]);
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::stoull(argv[++i]);
    } else if (arg == "--write-seeds" && i + 1 < argc) {
      const fs::path dir = argv[++i];
      fs::create_directories(dir);
      symbiosis::fuzz::write_seeds(dir);
      return 0;
    } else {
      paths.emplace_back(arg);
    }
  }
  std::vector<fs::path> files;
  for (const auto& path : paths) {
    if (fs::is_directory(path)) {
      for (const auto& entry : fs::directory_iterator(path)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
    } else if (fs::exists(path)) {
      files.push_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::fprintf(stderr, "no inputs in the paths given\n");
    return 2;
  }
  std::vector<std::string> inputs;
  for (const auto& file : files) inputs.push_back(read_all(file));
  for (const auto& input : inputs) run(input);
  std::mt19937_64 random(seed);
  size_t runs = inputs.size();
  for (const auto& input : inputs) {
    for (size_t m = 0; m < mutations; ++m, ++runs) run(mutate(input, inputs, random));
  }
  std::printf("%zu inputs (%zu files, %zu mutations of each) passed\n", runs, files.size(), mutations);
  return 0;
}
