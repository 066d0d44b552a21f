${ROUTER}
__threadfence_block();
__syncthreads();
if (threadIdx.x < 32) omnia::route<${T}, ${E}, ${TOPK}, ${ORDER}, ${NORMALIZE}>(y0, weights, ids);
