//! Every WGSL kernel, as the backend builds it (includes expanded, its constants declared, with
//! and without subgroups), parses and validates with naga, so a shader error fails `cargo test`
//! rather than a user's first run. The shader files and the kernel table agree.

use std::path::Path;

use tern::backend::gpu::Kernel;
use tern::backend::wgpu::shaders;

fn validate(what: &str, src: &str) -> naga::Module {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{what}:\n{}", e.emit_to_string(src)));
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    module
}

#[test]
fn every_kernel_validates() {
    let kernels = Kernel::all(&[16, 24, 32, 64, 128, 256]);
    let mut n = 0;
    for &k in &kernels {
        for sg in [false, true] {
            let src = shaders::source(k, sg);
            let module = validate(&format!("{k} subgroups {sg}"), &src);
            assert!(
                module.entry_points.iter().any(|ep| ep.name == "main"),
                "{k}: the backend expects a `main` entry point"
            );
            assert!(!src.contains("#include"), "{k}: an include was left");
            if sg && k.spec().file == "matmul_vec" {
                assert!(
                    src.contains("subgroupAdd(") && !src.contains("red[lid] += red[lid + s]"),
                    "{k}: subgroup variant not built"
                );
            }
            n += 1;
        }
    }
    println!("{n} kernel variants validate ({} kernels)", kernels.len());
}

/// Each constant a kernel is built with is declared once, by the host: a shader file that
/// declared one itself would fail to validate (a redeclaration), and one that does not use a
/// constant it is given would mean the table and the shader disagree.
#[test]
fn constants_come_from_the_table() {
    for k in Kernel::all(&[128]) {
        let spec = k.spec();
        let file = shaders::file(spec.file);
        for (name, _) in &spec.defines {
            assert!(
                !file.contains(&format!("const {name}:")),
                "shaders/{}.wgsl declares {name} itself",
                spec.file
            );
        }
        let src = shaders::source(k, false);
        for (name, _) in &spec.defines {
            assert!(
                words(&src, name) > 1,
                "{k}: constant {name} is declared but never used"
            );
        }
    }
}

/// Occurrences of `name` as a whole identifier.
fn words(src: &str, name: &str) -> usize {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    src.match_indices(name)
        .filter(|&(i, _)| {
            !src[..i].chars().next_back().is_some_and(ident)
                && !src[i + name.len()..].chars().next().is_some_and(ident)
        })
        .count()
}

/// The files in shaders/ are exactly the kernels and pieces the backend knows.
#[test]
fn files_match_the_table() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wgsl"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut known: Vec<String> = shaders::FILES.iter().map(|(n, _)| n.to_string()).collect();
    known.sort();
    assert_eq!(on_disk, known, "shaders/*.wgsl and shaders::FILES differ");
    let mut used: Vec<&str> = Kernel::all(&[128])
        .into_iter()
        .map(|k| k.spec().file)
        .chain(shaders::PIECES.iter().copied())
        .collect();
    used.sort();
    used.dedup();
    assert_eq!(
        used, known,
        "a shader file no kernel uses, or a kernel without a file"
    );
}
