"""Collective backends: MPI on the CPU (``mpi``); NCCL on the GPU comes with the GPU issue."""
