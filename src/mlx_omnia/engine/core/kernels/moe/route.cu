omnia::route<${T}, ${E}, ${TOPK}, ${ORDER}, ${NORMALIZE}>(logits, weights, ids);
