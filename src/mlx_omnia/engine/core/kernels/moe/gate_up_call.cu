omnia::expert_gate_up<${T}, ${BITS}, ${GROUP}, ${K}, ${HID}, ${TOPK}, ${LPR}, ${NWARPS}, ${NORM}${FLAGS}>(${x}, ${ids}, ${w}, ${s}, ${b}, ${out}, ${g}, ${eps}, ${block}${more});
