#!/bin/bash
# launch/slurm.sh: one llm_train run over N nodes of a SLURM cluster, preemption-safe.
#
#   sbatch --nodes=4 launch/slurm.sh 70b-zero3 [train.py arguments and key=value overrides ...]
#
# One srun task per node runs `accelerate launch` (launch/accelerate/multi_node_static.yaml), with
# the machine rank from SLURM_NODEID and node 0 of the allocation as the main address; accelerate
# starts one process per GPU on its node. Every start passes `--resume auto`: the first start
# finds no checkpoint and begins at step 0; a requeued start continues from the newest
# complete checkpoint in the run directory (which must be on a filesystem all nodes share).
#
# Stopping early, without losing work:
#   * time limit: SLURM sends SIGUSR1 to this script (--signal=B:USR1@SECONDS before the end); the
#     trap below sends SIGTERM to the training step (srun forwards it to every node's launcher,
#     torchrun forwards it to every worker), the workers finish the current step, commit a
#     checkpoint and exit, and the job is requeued. We forward SIGTERM rather than SIGUSR1
#     because torchrun only relays SIGTERM/SIGINT/SIGHUP/SIGQUIT to workers (a SIGUSR1 would end
#     the launcher itself); llm_train treats both signals the same way.
#   * preemption: SLURM itself sends SIGTERM to every process and, with --requeue, requeues the
#     job once it has ended. SLURM's grace time (KillWait / GraceTime) and torchrun's
#     TORCH_ELASTIC_SHUTDOWN_TIMEOUT must cover one step plus a checkpoint (checkpoint.grace_s).
#
# Edit the #SBATCH lines for your cluster (partition, account, GPUs per node, time).
#SBATCH --job-name=llm-train
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=llm-train-%j.out

set -uo pipefail

RECIPE=${1:?usage: sbatch launch/slurm.sh RECIPE [train.py arguments ...]}
shift

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# A port derived from the job id: two jobs sharing a node never collide on the rendezvous.
MAIN_PORT=${MAIN_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MAIN_ADDR MAIN_PORT GPUS_PER_NODE RECIPE
# Newer torchrun waits this long for workers to checkpoint after SIGTERM before killing them
# (older releases wait a fixed 30 s: keep checkpoint.grace_s below that there).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-280}
# Multi-node NCCL over the fast fabric: set NCCL_SOCKET_IFNAME / NCCL_IB_HCA here if your
# cluster needs them.

echo "llm-train: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, main $MAIN_ADDR:$MAIN_PORT"

STOP_REQUESTED=0
SRUN_PID=
on_usr1() {
    echo "llm-train: time limit near; asking the workers to checkpoint and stop"
    STOP_REQUESTED=1
    [ -n "$SRUN_PID" ] && kill -TERM "$SRUN_PID"
}
trap on_usr1 USR1

# bash -c on each node: SLURM_NODEID differs per node and must be read there, not here.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '
    exec accelerate launch --config_file launch/accelerate/multi_node_static.yaml \
        --num_machines "$SLURM_NNODES" --num_processes "$((SLURM_NNODES * GPUS_PER_NODE))" \
        --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" \
        llm_train/train.py --recipe "$RECIPE" --resume auto "$@"
' llm-train "$@" &
SRUN_PID=$!

# `wait` returns early when the trap fires; wait again for the step to finish its checkpoint.
wait "$SRUN_PID"
STATUS=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do
    wait "$SRUN_PID"
    STATUS=$?
done

if [ "$STOP_REQUESTED" = 1 ]; then
    echo "llm-train: checkpointed (exit $STATUS); requeueing job $SLURM_JOB_ID to resume"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$STATUS"
