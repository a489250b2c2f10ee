# Sourced by the other scripts: the environment meshtrain runs best in on this kind of machine.
# One BLAS thread per rank (ranks already fill the cores): OpenBLAS's, and oneDNN's (Debian's
# libdnnl runs on OpenMP, which takes OMP_NUM_THREADS).
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Debian's OpenBLAS mistakes some virtual CPUs with AVX-512 for a 2004 "Prescott" and falls
# back to its generic kernels (10x slower sgemm); name the core type when the CPU has AVX-512.
if [[ -z "${OPENBLAS_CORETYPE:-}" ]] && grep -q -w avx512f /proc/cpuinfo 2>/dev/null; then
  export OPENBLAS_CORETYPE=SkylakeX
fi
# Open MPI refuses to start as root without these.
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
