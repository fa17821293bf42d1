# stages: gemm-shapes
# gemm-shapes    the executor's GEMMs of the 1B shapes, one request alone against several packed (bench/gemm_shapes.py)
python3 bench/gemm_shapes.py
