//! Every WGSL file in shaders/ parses and validates with naga, so a shader error fails
//! `cargo test` rather than a user's first run.

use std::path::Path;

#[test]
fn all_shaders_validate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut n = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "wgsl"))
    {
        let src = std::fs::read_to_string(&path).unwrap();
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{}:\n{}", path.display(), e.emit_to_string(&src)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
        assert!(
            module.entry_points.iter().any(|ep| ep.name == "main"),
            "{}: the backend expects a `main` entry point",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 4, "only {n} shaders found");
    println!("{n} shaders validate");
}
