// AMX tiles (Sapphire Rapids and later; the amx level of aotlm.kernels.isa: -mamx-tile -mamx-int8 -mamx-bf16), included
// by wmatmul.cc before the GEMMs. Linux grants the tile state per process (arch_prctl(ARCH_REQ_XCOMP_PERM)):
// asked once, on first use; refused (an old kernel, a hypervisor that hides it), the vpdpbusd code runs.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define AOTLM_AMX 1  // the amx build: the code below and what tests this macro
namespace aotlm_amx {
constexpr int64_t MIN_ROWS = 16;  // decode rows (<= kernels.MAX_ROWS) stay on the row kernels
// int16 x times int8 panels (amx16i.h): up to 32 rows the row kernels, which read W once where the tiles
// regroup it first (kernels README, AMX)
constexpr int64_t MIN_ROWS_I16 = 32;

inline bool ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes (palette 1), loaded into the calling thread.
inline void config_16x64() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}
}  // namespace aotlm_amx
#endif
