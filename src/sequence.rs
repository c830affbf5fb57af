//! Single-sequence forms of attention (to be written).
