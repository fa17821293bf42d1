# stages: shell
# shell          GPU_SHELL, a command line run with this script's environment ($B the binaries, $out, the
#                loader's paths): a diagnosis that no stage makes
B=$B out=$out bash -c "$GPU_SHELL" 2>&1 | tail -80
