#!/bin/sh
# Runs one rank of an NCCL test ("$@") under mpiexec. NCCL refuses two ranks of one
# communicator on one GPU, so when a node runs more ranks than it has GPUs (a one-GPU
# machine running a test at np 2) each rank poses as a host of its own (NCCL_HOSTID) and
# they talk over sockets on the loopback; with a GPU per rank, or none, nothing changes.
ranks=${OMPI_COMM_WORLD_LOCAL_SIZE:-${MPI_LOCALNRANKS:-1}}
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
if [ "$gpus" -gt 0 ] && [ "$ranks" -gt "$gpus" ]; then
  export NCCL_HOSTID=meshtrain-rank-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}} NCCL_NET=Socket \
    NCCL_SHM_DISABLE=1 NCCL_P2P_DISABLE=1 NCCL_SOCKET_IFNAME=lo
fi
exec "$@"
