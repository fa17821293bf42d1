# stages: restart
# restart        gpu_restart_test alone (generation and training across an executor killed and restarted)
run_gtest gpu_restart_test
