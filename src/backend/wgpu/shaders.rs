//! The WGSL sources (`shaders/*.wgsl`, one op each) and the small preprocessor that makes a
//! kernel's source from them:
//! - `#include "piece.wgsl"` lines are replaced by that file: the weight decoders
//!   (`decode.wgsl`), the workgroup sum (`reduce.wgsl`), softplus (`softplus.wgsl`) and the
//!   exact f32 -> f16 conversion (`f16.wgsl`) live once and the kernels that need them include
//!   them;
//! - the kernel's constants ([`Kernel::spec`]: its workgroup size, tile sizes, dtype codes, the
//!   head size) are declared at the top, after any `enable` directive, so that the host and the
//!   CUDA port read the same table and no shader declares them itself;
//! - on an adapter with subgroups, the lines between `//#if subgroups` and `//#else` are
//!   uncommented and those up to `//#endif` dropped (without, the source is used as written).

use crate::backend::gpu::kernels::{wgsl_consts, Kernel};

macro_rules! shader_files {
    ($($name:literal),* $(,)?) => {
        /// Every file in `shaders/`, by stem.
        pub const FILES: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("../../../shaders/", $name, ".wgsl")))),*
        ];
    };
}

shader_files!(
    "add",
    "add_bias",
    "add_scaled",
    "argmax",
    "attn_combine",
    "attn_prep",
    "attn_split",
    "concat_cols",
    "decode",
    "embed",
    "f16",
    "fwht",
    "fwht_stage",
    "gdn_chunk_prep",
    "gdn_chunk_scan",
    "gdn_conv",
    "gdn_gated_norm",
    "gdn_step",
    "gelu",
    "kv_store",
    "layer_norm",
    "matmul_tiled",
    "matmul_vec",
    "matmul_vec_f16",
    "reduce",
    "rms_norm",
    "softplus",
    "swiglu",
    "topk",
    "vision_attn",
    "vision_rope",
);

/// Files that are pieces for `#include`, not kernels.
pub const PIECES: &[&str] = &["decode", "f16", "reduce", "softplus"];

/// The text of `shaders/<stem>.wgsl`.
pub fn file(stem: &str) -> &'static str {
    FILES
        .iter()
        .find(|(n, _)| *n == stem)
        .map(|(_, s)| *s)
        .unwrap_or_else(|| panic!("no shader shaders/{stem}.wgsl"))
}

/// `#include "name.wgsl"` → the stem.
fn include_of(line: &str) -> Option<&str> {
    let rest = line.trim().strip_prefix("#include")?.trim();
    let name = rest.strip_prefix('"')?.strip_suffix('"')?;
    Some(name.strip_suffix(".wgsl").unwrap_or(name))
}

fn expand(stem: &str, out: &mut String, depth: usize) {
    assert!(depth < 8, "shaders: #include nests too deep at {stem}.wgsl");
    for line in file(stem).lines() {
        match include_of(line) {
            Some(piece) => {
                out.push_str(&format!("// ---- {piece}.wgsl ----\n"));
                expand(piece, out, depth + 1);
                out.push_str(&format!("// ---- end of {piece}.wgsl ----\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// Applies the `//#if subgroups` regions.
fn subgroup_regions(source: &str, subgroups: bool) -> String {
    enum Region {
        Common,
        If,
        Else,
    }
    let mut region = Region::Common;
    let mut out = String::with_capacity(source.len());
    for line in source.lines() {
        match line.trim() {
            "//#if subgroups" => region = Region::If,
            "//#else" => region = Region::Else,
            "//#endif" => region = Region::Common,
            _ => {
                let keep = match region {
                    Region::Common => Some(line),
                    Region::If if subgroups => Some(line.strip_prefix("//").unwrap_or_else(|| {
                        panic!("line {line:?} in an `//#if subgroups` region is not commented out")
                    })),
                    Region::If => Some(line),
                    Region::Else if subgroups => None,
                    Region::Else => Some(line),
                };
                if let Some(l) = keep {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
    }
    out
}

/// The source wgpu compiles for `kernel`, with subgroup operations where the adapter has
/// them.
pub fn source(kernel: Kernel, subgroups: bool) -> String {
    let spec = kernel.spec();
    let mut body = String::new();
    expand(spec.file, &mut body, 0);
    let body = subgroup_regions(&body, subgroups);
    // Directives (`enable f16;`) must come before any declaration.
    let mut head = String::new();
    let mut rest = String::with_capacity(body.len() + 256);
    let mut in_head = true;
    for line in body.lines() {
        let t = line.trim();
        if in_head && (t.starts_with("enable ") || t.starts_with("requires ")) {
            head.push_str(line);
            head.push('\n');
            continue;
        }
        if !t.is_empty() && !t.starts_with("//") {
            in_head = false;
        }
        rest.push_str(line);
        rest.push('\n');
    }
    format!(
        "{head}// ---- constants of {kernel} (backend::gpu::kernels) ----\n{}{rest}",
        wgsl_consts(&spec)
    )
}
