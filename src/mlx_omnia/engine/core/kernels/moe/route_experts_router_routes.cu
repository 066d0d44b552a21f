  if (threadIdx.x == 0) routes = atomicAdd(count + 3, 1) == ${LAST_ROUTER};
  __syncthreads();
  if (routes) {
    __threadfence();
    if (threadIdx.x < 32) omnia::route<${T}, ${E}, ${TOPK}, ${ORDER}, ${NORMALIZE}, true>(logits, wts, ids);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(count + 4, 1);
  }
