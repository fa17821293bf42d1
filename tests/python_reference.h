// [Reference server] (tests/reference/server.py): the C++ tests' way to run a reference script of
// tests/reference with the tests' Python, without paying Python's start-up (torch, transformers,
// peft: about 10 s of CPU) in every test process.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace symbiosis::testing {

// Runs tests/reference/SCRIPT ARGS..., as `python SCRIPT ARGS... > log 2>&1` would, in a child of
// the reference server (started on first use, shared by every test process of this build, gone
// after a while without requests); without a server that answers, runs the script directly.
// Returns its exit status (3: a Python package is missing; the script says which in `log`).
int run_reference(const std::string& script, const std::vector<std::string>& args, const std::filesystem::path& log);

}  // namespace symbiosis::testing
