${T}* q = reinterpret_cast<${T}*>(const_cast<float*>(scratch));
${T}* k = q + ${K_AT};
${T}* v = k + ${V_AT};
float* part_o = const_cast<float*>(scratch + ${PART_O});
float* part_ml = part_o + ${PART_ML};
${CHAIN}
