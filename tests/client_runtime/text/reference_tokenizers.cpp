#include "tests/client_runtime/text/reference_tokenizers.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sys/wait.h>

namespace symbiosis::testing {

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

const ReferenceTokenizers* reference_tokenizers(std::string& why) {
  // Removes the directory when the process ends.
  struct Made {
    std::unique_ptr<ReferenceTokenizers> tokenizers;
    ~Made() {
      if (tokenizers) std::filesystem::remove_all(tokenizers->dir);
    }
  };
  static Made made;
  static std::string failure;
  static bool tried = false;
  if (!tried) {
    tried = true;
    const auto dir = new_temp_dir("symbiosis-tokenizers");
    const std::string command = std::string("'") + SYMBIOSIS_PYTHON + "' '" + SYMBIOSIS_SOURCE_DIR +
                                "/tests/reference/tokenizers_reference.py' --output '" + dir.string() + "'";
    const int status = std::system(command.c_str());
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 3) {
      failure = std::string("the Python at ") + SYMBIOSIS_PYTHON + " lacks tokenizers, sentencepiece, protobuf or transformers";
    } else if (code != 0) {
      ADD_FAILURE() << "failed (" << code << "): " << command;
      failure = "the reference script failed";
    } else {
      std::ifstream in(dir / "expected.json");
      made.tokenizers = std::make_unique<ReferenceTokenizers>(ReferenceTokenizers{dir, nlohmann::json::parse(in)});
    }
  }
  why = failure;
  return made.tokenizers.get();
}

}  // namespace symbiosis::testing
