  if (threadIdx.x == 0) atomicAdd(count + 3, 1);
