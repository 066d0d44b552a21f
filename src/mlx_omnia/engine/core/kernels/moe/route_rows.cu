omnia::route<${T}, ${E}, ${TOPK}, ${ORDER}, ${NORMALIZE}>(logits + (size_t)blockIdx.x * ${E}, weights + (size_t)blockIdx.x * ${TOPK}, ids + (size_t)blockIdx.x * ${TOPK});
