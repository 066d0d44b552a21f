omnia::qmv<${T}, ${BITS}, ${GROUP}, ${K}, ${N0}, ${N1}, ${N2}, ${R}, ${LPR}, ${NWARPS}, ${UNROLL}, ${PREF}, ${LOOP}, ${NORM}, ${ACT}, ${RESID}, ${CG}${EXT}>(
    ${x}, ${w0}, ${s0}, ${b0}, ${w1}, ${s1}, ${b1}, ${w2}, ${s2}, ${b2}, ${g}, ${res}, ${y0}, ${y1}, ${y2}, ${eps}, ${block}${more});
