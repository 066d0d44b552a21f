${T}* mid = reinterpret_cast<${T}*>(const_cast<float*>(scratch));
${CHAIN}
