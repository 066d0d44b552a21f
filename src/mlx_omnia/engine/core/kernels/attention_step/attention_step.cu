float* part_o = const_cast<float*>(scratch);
float* part_ml = part_o + ${PART_ML};
${ATTENTION}
