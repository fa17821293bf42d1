# stages: gemm-shapes
# gemm-shapes    the executor's GEMMs of the 1B shapes, requests alone (one after another, and side by side on
#                streams of their own) against packed (bench/gemm_shapes.py): 1 024-row requests, then
#                decode calls of 8 rows
python3 bench/gemm_shapes.py
python3 bench/gemm_shapes.py --tokens 8
