# stages: patched
# patched        the scenario in SCENARIO with the JSON in PATCH merged over its top level
#                (e.g. PATCH='{"executor": {...}, "baselines": []}'), at COUNTS, under MPS
make_1b
mps_on
patch_scenario "$SCENARIO" "$PATCH" > /tmp/patched.json
bench patched /tmp/patched.json --checkpoint $model_1b --counts "${COUNTS:-8}"
mps_off
