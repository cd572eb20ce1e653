// The key order of an e4m3 P·V. The k32 A operand of an FP8 wgmma gives a thread four consecutive
// k slots per register (slots 4t … 4t + 3 of a 16-slot half, t = lane % 4), while the QKᵀ
// accumulator gives it keys 2t, 2t + 1 of each 8-key block. Rather than shuffle P between the
// two, the kernel lets slot s of a 16-key group hold key key_of_slot(s): the accumulator's values
// then pack into A registers in place, and Vᵀ is written with its keys in the same order, so that
// Σ_s P[key(s)] · V[key(s)] is P·V unchanged (O's columns are dims: nothing to undo).
#pragma once

namespace fa4::sm90::fp8 {

inline constexpr int kKeyGroup = 16;  // the permutation acts within each 16-key group

// Slot s = 4t + j (t = lane % 4 of the S accumulator, j < 4) of a 16-key group holds key
// 8 · (j / 2) + 2t + j % 2: j = 0, 1 from the thread's first 8-key block, j = 2, 3 from its second.
constexpr int key_of_slot(int s) { return 8 * ((s % 4) / 2) + 2 * (s / 4) + s % 2; }

// The inverse: key k = 8b + 2t + c (b, c < 2) sits in slot 4t + 2b + c.
constexpr int slot_of_key(int k) { return 4 * ((k % 8) / 2) + 2 * (k / 8) + k % 2; }

}  // namespace fa4::sm90::fp8
