BUILD_DIR     ?= build
CTEST_JOBS    ?= 2
CTEST_TIMEOUT ?= 900
export BUILD_DIR

.PHONY: build demo test clean

# Install what is missing (apt, the venv), configure if needed, build.
build:
	bash scripts/setup.sh

demo: build
	bash examples/demo.sh $(BUILD_DIR)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j$(CTEST_JOBS) --timeout $(CTEST_TIMEOUT)

# The build folder only; the venv (~/.cache/symbiosis/venv) stays.
clean:
	rm -rf $(BUILD_DIR)
