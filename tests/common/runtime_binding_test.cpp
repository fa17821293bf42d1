// [libstdc++ first] (the top-level CMakeLists.txt): libtorch.so exports its own copy of
// std::filesystem, whose remove_all jumps to address 0 when called from our programs. Every
// program of ours must bind std::filesystem to libstdc++'s. When the link order slipped on the
// GPU machine's toolchain, symbiosis-bench-roundtrip died with a segmentation fault at its first
// remove_all; this test, linked as every program is, fails on such a build instead.
#include <ATen/ATen.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/test_util.h"

namespace symbiosis {
namespace {

std::string library_of(void* function) {
  Dl_info info{};
  if (dladdr(function, &info) == 0 || info.dli_fname == nullptr) return "(unknown)";
  return info.dli_fname;
}

TEST(RuntimeBinding, StdFilesystemBindsToLibstdcxxNotLibtorch) {
  // This program uses LibTorch as every program of ours does.
  ASSERT_EQ(at::ones({2}).sum().item<float>(), 2.0f);
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const RemoveAll remove_all = &std::filesystem::remove_all;
  const std::string library = library_of(reinterpret_cast<void*>(remove_all));
  EXPECT_NE(library.find("libstdc++"), std::string::npos)
      << "std::filesystem::remove_all binds to " << library << ", not libstdc++ (see [libstdc++ first])";
  const auto dir = testing::temp_dir("binding");
  std::filesystem::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "file") << "x";
  EXPECT_EQ(std::filesystem::remove_all(dir), 4u);
  EXPECT_FALSE(std::filesystem::exists(dir));
}

}  // namespace
}  // namespace symbiosis
