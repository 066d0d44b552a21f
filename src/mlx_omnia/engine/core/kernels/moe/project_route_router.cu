${ROUTER}
__threadfence();
__syncthreads();
__shared__ int routes;
if (threadIdx.x == 0) { routes = atomicAdd(count + 3, 1) == ${LAST}; if (routes) count[3] = 0; }
__syncthreads();
if (routes && threadIdx.x < 32) {
  __threadfence();
  omnia::route<${T}, ${E}, ${TOPK}, ${ORDER}, ${NORMALIZE}, true>(logits, weights, ids);
}
