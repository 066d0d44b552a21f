omnia::${CALL}<${T}, ${BITS}, ${GROUP}, ${K}, ${OUT}, ${TOPK}, ${LPE}, ${NWARPS}, ${RESID}, ${CG}${FLAGS}>(${h}, ${ids}, ${wts}, ${w}, ${s}, ${b}, ${res}, ${out}, ${block}${more});
