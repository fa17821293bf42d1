# stages: patched
# patched        the scenario in SCENARIO with the JSON in PATCH merged over its top level
#                (e.g. PATCH='{"executor": {...}, "baselines": []}'), at COUNTS, under MPS
make_1b
mps_on
python3 - "$SCENARIO" "$PATCH" > /tmp/patched.json <<'PY'
import json, sys
scenario = json.load(open(sys.argv[1]))
scenario.update(json.loads(sys.argv[2]))
print(json.dumps(scenario))
PY
bench patched /tmp/patched.json --checkpoint $model_1b --counts "${COUNTS:-8}"
mps_off
