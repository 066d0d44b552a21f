__shared__ __align__(16) char ext[${EXT}];
__shared__ int ticket;
__shared__ int routes;
int* count = const_cast<int*>(counters);
char* sc = reinterpret_cast<char*>(const_cast<float*>(scratch));
${T}* h = reinterpret_cast<${T}*>(sc);
${T}* logits = reinterpret_cast<${T}*>(sc + ${LOGITS});
${T}* wts = reinterpret_cast<${T}*>(sc + ${WEIGHTS});
unsigned int* ids = reinterpret_cast<unsigned int*>(sc + ${IDS});
${T}* mid = reinterpret_cast<${T}*>(sc + ${MID});
if (threadIdx.x == 0) ticket = atomicAdd(count, 1);
__syncthreads();
const int t = ticket;
if (t < ${PROJECT_END}) {
${PROJECT}
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(count + 1, 1);
  return;
}
if (t < ${ROUTER_END}) {
${ROUTER}
  __threadfence();
  __syncthreads();
${ROUTER_DONE}
  return;
}
${EXPERTS_ROUTE}
if (t < ${GATE_UP_END}) {
${GATE_UP}
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(count + 5, 1);
  return;
}
${DOWN}
if (threadIdx.x == 0 && atomicAdd(count + 2, 1) == ${LAST}) {
  count[0] = 0; count[1] = 0; count[2] = 0; count[3] = 0; count[4] = 0; count[5] = 0;
}
