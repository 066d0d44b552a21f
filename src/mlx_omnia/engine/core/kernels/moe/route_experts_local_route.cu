__shared__ unsigned int l_ids[${TOPK}];
__shared__ ${T} l_wts[${TOPK}];
omnia::wait_published(count + 3, ${ROUTERS});
if (threadIdx.x < 32) omnia::route<${T}, ${E}, ${TOPK}, ${ORDER}, ${NORMALIZE}, true>(logits, l_wts, l_ids);
__syncthreads();
