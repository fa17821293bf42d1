#include "tests/client_runtime/text/reference_tokenizers.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/file.h>

#include <fstream>
#include <iterator>
#include <memory>

#include "tests/python_reference.h"

namespace symbiosis::testing {

std::filesystem::path with_tokenizer(const ReferenceTokenizers& reference, const std::string& family,
                                     const std::filesystem::path& checkpoint, const std::filesystem::path& out) {
  namespace fs = std::filesystem;
  fs::copy(checkpoint, out, fs::copy_options::recursive);
  for (const auto& file : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"}) {
    if (fs::exists(reference.dir / family / file)) fs::copy(reference.dir / family / file, out / file);
  }
  return out;
}

std::filesystem::path new_temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  const char* made = mkdtemp(pattern.data());
  if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
  return made;
}

std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

namespace {

namespace fs = std::filesystem;

// The script's output lies in the build folder, made once for every test process of the build (and
// again when the script changes): the tests only read it. Returns the script's exit status.
int make_once(const fs::path& script, const fs::path& dir) {
  const fs::path done = dir / "made";  // the script wrote everything (expected.json names files in `dir`)
  if (fs::exists(done)) return 0;
  fs::create_directories(dir.parent_path());
  const int lock = ::open((dir.string() + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ::flock(lock, LOCK_EX);  // released with the descriptor
  int code = 0;
  if (!fs::exists(done)) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    code = run_reference(script.filename().string(), {"--output", dir.string()}, dir.string() + ".log");
    if (code == 0) std::ofstream(done) << "\n";
  }
  ::close(lock);
  return code;
}

}  // namespace

const ReferenceTokenizers* reference_tokenizers(std::string& why) {
  static std::unique_ptr<ReferenceTokenizers> made;
  static std::string failure;
  static bool tried = false;
  if (!tried) {
    tried = true;
    const fs::path script = fs::path(SYMBIOSIS_SOURCE_DIR) / "tests" / "reference" / "tokenizers_reference.py";
    std::ifstream source(script, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(source)), std::istreambuf_iterator<char>());
    const fs::path dir = fs::path(SYMBIOSIS_BINARY_DIR) / "tests" /
                         ("reference-tokenizers-" + std::to_string(std::hash<std::string>{}(text)));
    const int code = make_once(script, dir);
    if (code == 3) {
      failure = std::string("the Python at ") + SYMBIOSIS_PYTHON +
                " lacks tokenizers, sentencepiece, protobuf or transformers";
    } else if (code != 0) {
      ADD_FAILURE() << script << " failed (" << code << "): see " << dir.string() << ".log";
      failure = "the reference script failed";
    } else {
      std::ifstream in(dir / "expected.json");
      made = std::make_unique<ReferenceTokenizers>(ReferenceTokenizers{dir, nlohmann::json::parse(in)});
    }
  }
  why = failure;
  return made.get();
}

}  // namespace symbiosis::testing
