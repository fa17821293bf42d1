# stages: trainer
# trainer        gpu_trainer_test alone (the tenant trainer's captured steps, symbiosis-finetune on a GPU), under MPS
mps_on
run_gtest gpu_trainer_test
mps_off
