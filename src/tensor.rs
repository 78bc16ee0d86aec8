//! Tensor element types as GGUF/ggml number them, and shape arithmetic shared by the reader,
//! the quantizers and the backends.

use std::fmt;

/// A ggml tensor type id as stored in a GGUF tensor table.
///
/// Every id the reader may meet in a real file is named so that `tern inspect` can describe
/// it; only the ones with `can_compute() == true` have kernels.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ2XXS,
    IQ2XS,
    IQ3XXS,
    IQ1S,
    IQ4NL,
    IQ3S,
    IQ2S,
    IQ4XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    /// Upstream Q1_0 at group 128 (id 41).
    Q1_0,
    /// Upstream Q2_0 at group 64 (id 42, 18 bytes per block).
    Q2_0,
    /// The pre-v7 PrismML Q2_0 at group 128: id 42 on disk, byte-identical to PQ2_0. The reader
    /// only yields this when the tensor's byte span proves the 34 B / 128 layout.
    Q2_0Legacy,
    /// PrismML ternary, 2 bits per weight, group 128 (id 142).
    PQ2_0,
    /// PrismML ternary in base-3 trits, group 128 (id 143).
    PTQ1_0,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => IQ2XXS,
            17 => IQ2XS,
            18 => IQ3XXS,
            19 => IQ1S,
            20 => IQ4NL,
            21 => IQ3S,
            22 => IQ2S,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            41 => Q1_0,
            42 => Q2_0,
            142 => PQ2_0,
            143 => PTQ1_0,
            _ => return None,
        })
    }

    /// The id written to disk (the legacy layout keeps its historical id 42).
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            IQ2XXS => 16,
            IQ2XS => 17,
            IQ3XXS => 18,
            IQ1S => 19,
            IQ4NL => 20,
            IQ3S => 21,
            IQ2S => 22,
            IQ4XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            Q1_0 => 41,
            Q2_0 | Q2_0Legacy => 42,
            PQ2_0 => 142,
            PTQ1_0 => 143,
        }
    }

    /// (elements per block, bytes per block), as ggml's type traits give them.
    pub fn block(self) -> (usize, usize) {
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            IQ2XXS => (256, 66),
            IQ2XS => (256, 74),
            IQ3XXS => (256, 98),
            IQ1S => (256, 50),
            IQ4NL => (32, 18),
            IQ3S => (256, 110),
            IQ2S => (256, 82),
            IQ4XS => (256, 136),
            IQ1M => (256, 56),
            TQ1_0 => (256, 54),
            TQ2_0 => (256, 66),
            MXFP4 => (32, 17),
            Q1_0 => (128, 18),
            Q2_0 => (64, 18),
            Q2_0Legacy | PQ2_0 => (128, 34),
            PTQ1_0 => (128, 28),
        }
    }

    pub fn block_size(self) -> usize {
        self.block().0
    }

    pub fn type_size(self) -> usize {
        self.block().1
    }

    /// Whether tern has dequantization and kernels for this type.
    pub fn can_compute(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q8_0 | Q4_0 | PQ2_0 | PTQ1_0 | Q2_0Legacy
        )
    }

    /// Bytes of one row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let (bs, ts) = self.block();
        if !n.is_multiple_of(bs as u64) {
            return None;
        }
        (n / bs as u64).checked_mul(ts as u64)
    }

    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ2XXS => "IQ2_XXS",
            IQ2XS => "IQ2_XS",
            IQ3XXS => "IQ3_XXS",
            IQ1S => "IQ1_S",
            IQ4NL => "IQ4_NL",
            IQ3S => "IQ3_S",
            IQ2S => "IQ2_S",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            Q1_0 => "Q1_0",
            Q2_0 => "Q2_0",
            Q2_0Legacy => "Q2_0(legacy-g128)",
            PQ2_0 => "PQ2_0",
            PTQ1_0 => "PTQ1_0",
        }
    }

    /// Parses the names used on the command line and in configs (`f16`, `q8_0`, ...).
    pub fn parse_name(s: &str) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" => F32,
            "f16" => F16,
            "bf16" => BF16,
            "q8_0" => Q8_0,
            "q4_0" => Q4_0,
            "pq2_0" => PQ2_0,
            "ptq1_0" => PTQ1_0,
            _ => return None,
        })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for id in 0..200u32 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id, "{t}");
            }
        }
        assert_eq!(GgmlType::from_id(142), Some(GgmlType::PQ2_0));
        assert_eq!(GgmlType::from_id(143), Some(GgmlType::PTQ1_0));
        assert_eq!(GgmlType::from_id(4), None);
    }

    #[test]
    fn row_bytes_match_block_tables() {
        assert_eq!(GgmlType::PQ2_0.row_bytes(1024), Some(8 * 34));
        assert_eq!(GgmlType::PTQ1_0.row_bytes(256), Some(56));
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::Q8_0.row_bytes(65), None);
        assert_eq!(GgmlType::F16.row_bytes(3), Some(6));
    }
}
