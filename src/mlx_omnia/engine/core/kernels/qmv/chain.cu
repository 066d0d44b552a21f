__shared__ int ticket;
int* count = const_cast<int*>(counters);
if (threadIdx.x == 0) ticket = atomicAdd(count, 1);
__syncthreads();
const int t = ticket;
if (t < ${NB1}) {
${FIRST}
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(count + 1, 1);
  return;
}
${SECOND}
if (threadIdx.x == 0 && atomicAdd(count + 2, 1) == ${LAST}) {
  count[0] = 0;
  count[1] = 0;
  count[2] = 0;
}
