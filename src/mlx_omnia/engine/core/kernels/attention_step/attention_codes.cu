float* part_o = const_cast<float*>(scratch);
float* part_ml = part_o + ${PART_ML};
omnia::attention_codes<${T}, ${H}, ${HKV}, ${D}, ${BITS}, ${GS}, ${KPB}, ${WALK}, ${HS}>(q, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, pos, counters, part_o, part_ml, out, ${scale}, k_codes_shape[2], blockIdx.x);
