const int cap = ${k_cache}_shape[2];
const int slices = ${WALK} && cap / ${KPB} > ${MAX_SLICES} ? ${MAX_SLICES} : cap / ${KPB};
const int per_row = ${HKV} * ${HSN} * slices;
const int b = blockIdx.x / per_row;
float* part_o = partials + (size_t)b * slices * ${H} * (${D} + 2);
float* part_ml = part_o + (size_t)slices * ${H} * ${D};
omnia::attention_step<${T}, ${H}, ${HKV}, ${D}, ${KPB}, ${QN}, ${KN}, ${TRAD}, ${WALK}, false${HS}>(q + (size_t)b * ${H} * ${D}, k_new + (size_t)b * ${HKV} * ${D}, v_new + (size_t)b * ${HKV} * ${D}, ${qw}, ${kw}, inv_freq, k_cache + (size_t)b * ${HKV} * cap * ${D}, v_cache + (size_t)b * ${HKV} * cap * ${D}, pos + b, counters + b * ${HKV} * ${MAXHS}, part_o, part_ml, out + (size_t)b * ${H} * ${D}, nullptr, ${eps_q}, ${eps_k}, ${scale}, cap, blockIdx.x % per_row);
