# stages: tinker-rl
# tinker-rl      symbiosis-tinker: TINKER_RUNS (1,4,8) concurrent RL runs of the tinker SDK against one after another
#                (bench/tinker_rl.py, Llama-3.2-1B, bf16); needs the wheels in .whl (tinker, pyqwest, ...)
make_1b
python_package || return
mps_on
timeout "${TINKER_TIMEOUT_S:-420}" python3 bench/tinker_rl.py --build "$B" --model $model_1b --runs "${TINKER_RUNS:-1,4,8}" ${TINKER_FLAGS:-} \
  --device cuda:0 --dtype bf16 --out "$out/tinker-rl.json" > $logs/tinker-rl.txt 2>&1
log "tinker-rl exited $?: $(grep -E '^\{"runs"' $logs/tinker-rl.txt | cut -c1-220)"
[ -f "$out/tinker-rl.json" ] || tail -30 $logs/tinker-rl.txt
mps_off
