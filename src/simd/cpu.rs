//! What the kernels decide from the CPU's identity rather than from its
//! feature flags: constants that measured differently on Intel and AMD
//! cores with the same instruction sets. Decided once, from `cpuid`, never
//! by timing, so a call's path (and so its bits) never depends on a
//! measurement.

/// Whether this is an Intel CPU (`cpuid` leaf 0 reads "GenuineIntel").
/// `false` off x86-64, and under Miri, which cannot run `cpuid`.
pub(crate) fn is_intel() -> bool {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *INTEL.get_or_init(|| {
            // Leaf 0: the vendor string in EBX, EDX, ECX.
            let vendor = std::arch::x86_64::__cpuid(0);
            let name = [vendor.ebx, vendor.edx, vendor.ecx].map(u32::to_le_bytes);
            name.concat() == b"GenuineIntel"
        })
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    false
}
