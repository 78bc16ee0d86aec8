//! The YAML config: one schema with the flags, strict keys and values, file-then-flags merge,
//! and the shipped example.

use std::path::{Path, PathBuf};

use clap::Parser;
use tern::cli::config::{run_to, ConfigArgs};
use tern::config::{ConfigError, LoraScaled, Reasoning, ReasoningFormat, Settings};
use tern::plan::{BackendKind, FlashAttn, KvType, SpecType};

fn parse(yaml: &str) -> Result<Settings, ConfigError> {
    Settings::from_yaml(yaml, Path::new("test.yaml"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tern-config-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn zealot() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/zealot.yaml")
}

/// The flags as a subcommand would parse them.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    s: Settings,
}

fn flags(args: &[&str]) -> Settings {
    Flags::try_parse_from(std::iter::once("tern").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{e}"))
        .s
}

#[test]
fn the_shipped_example_is_the_seed_shape() {
    let s = Settings::load(zealot()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s.model.as_deref(),
        Some(Path::new(
            "/home/dank/models/Bonsai2-9B-MTP/Ternary-Bonsai-2-9B-PQ2_0-MTP-Q8_0.gguf"
        ))
    );
    assert_eq!(
        s.mmproj.as_deref(),
        Some(Path::new(
            "/home/dank/models/Bonsai2-9B-MTP/Ternary-Bonsai-2-9B-mmproj-Q8_0.gguf"
        ))
    );
    assert_eq!(s.alias.as_deref(), Some("frank-zealot"));
    assert_eq!(s.host.as_deref(), Some("0.0.0.0"));
    assert_eq!(s.port, Some(7771));
    assert_eq!(s.n_gpu_layers, Some(99));
    assert_eq!(s.jinja, Some(true));
    assert_eq!(s.metrics, Some(true));
    assert_eq!(s.reasoning, Some(Reasoning::Auto));
    assert_eq!(s.reasoning_format, Some(ReasoningFormat::Deepseek));
    assert_eq!(s.log_verbosity, Some(4));
    assert_eq!(s.presence_penalty, Some(1.0));
    assert_eq!(s.spec_draft_n_min, Some(0));
    assert_eq!(s.spec_draft_p_min, Some(0.0));
    assert_eq!(s.device_mib, Some(24_123));
    let sh = s.shape();
    assert_eq!(
        (sh.ctx_size, sh.parallel, sh.n_ctx_slot()),
        (602_112, 3, 200_704)
    );
    assert_eq!(
        (sh.cache_type_k, sh.cache_type_v),
        (KvType::F16, KvType::Q8_0)
    );
    assert_eq!(sh.flash_attn, FlashAttn::On);
    assert_eq!((sh.spec, sh.draft_n_max), (SpecType::DraftMtp, 2));
    assert_eq!(
        (sh.spec_draft_type_k, sh.spec_draft_type_v),
        (KvType::F16, KvType::F16)
    );
    assert_eq!((sh.ubatch_size, sh.batch_size), (1024, 6144));
    assert_eq!(sh.backend, BackendKind::Cuda);
    assert_eq!(sh.margin_mib, 1024);
}

#[test]
fn unknown_keys_are_errors_naming_them() {
    let e = parse("ctx-size: 4096\nctx-sise: 8192\n").unwrap_err();
    let m = e.to_string();
    assert!(m.contains("ctx-sise"), "{m}");
    assert!(m.contains("line 2"), "{m}");
    // The invented variable of the old deployment: never swallowed.
    let m = parse("kv-cache-type: q8_0\n").unwrap_err().to_string();
    assert!(m.contains("kv-cache-type"), "{m}");
    // Underscores are not the flag names.
    let m = parse("cache_type_k: f16\n").unwrap_err().to_string();
    assert!(m.contains("cache_type_k"), "{m}");
}

#[test]
fn bad_values_are_errors_naming_the_key() {
    let cases = [
        ("cache-type-v: q9_0\n", "cache-type-v", "q9_0"),
        ("port: -1\n", "port", "port: -1"),
        ("port: 70000\n", "port", "70000"),
        ("ctx-size: lots\n", "ctx-size", "lots"),
        ("flash-attn: maybe\n", "flash-attn", "maybe"),
        ("spec-type: draft-eagle\n", "spec-type", "draft-eagle"),
        ("backend: tpu\n", "backend", "tpu"),
        ("temp: hot\n", "temp", "hot"),
        (
            "lora-scaled: [a.gguf:0.5, b.gguf]\n",
            "lora-scaled[1]",
            "FILE:SCALE",
        ),
        (
            "lora-scaled: [a.gguf:x]\n",
            "lora-scaled[0]",
            "not a number",
        ),
        ("model: [a, b]\n", "model", ""),
    ];
    for (yaml, key, also) in cases {
        let e = parse(yaml).unwrap_err();
        match &e {
            ConfigError::Yaml { key: k, .. } => assert_eq!(k, key, "{yaml:?}: {e}"),
            other => panic!("{yaml:?}: {other}"),
        }
        let m = e.to_string();
        assert!(m.contains(&format!("key `{key}`")), "{yaml:?}: {m}");
        assert!(m.contains(also), "{yaml:?}: {m}");
        assert!(m.contains("test.yaml"), "{m}");
    }
    // Malformed documents and duplicate keys.
    assert!(parse("[1, 2]\n").is_err());
    let m = parse("port: 80\nport: 81\n").unwrap_err().to_string();
    assert!(m.contains("duplicate") && m.contains("port"), "{m}");
    assert!(parse("ctx-size: 4096\n  parallel: 2\n").is_err());
}

#[test]
fn range_checks_name_the_key() {
    for (yaml, key) in [
        ("top-p: 1.5\n", "top-p"),
        ("min-p: -0.1\n", "min-p"),
        ("temp: -1\n", "temp"),
        ("seed: -2\n", "seed"),
        ("parallel: 0\n", "parallel"),
        ("ctx-size: 602113\nparallel: 3\n", "ctx-size"),
        (
            "spec-draft-n-min: 3\nspec-draft-n-max: 2\n",
            "spec-draft-n-min",
        ),
    ] {
        let path = tmp("range.yaml");
        std::fs::write(&path, yaml).unwrap();
        let e = Settings::load(&path).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
            "{yaml:?}: {e}"
        );
        assert!(e.to_string().starts_with(key), "{e}");
    }
}

#[test]
fn empty_and_comment_only_files_set_nothing() {
    assert_eq!(parse("").unwrap(), Settings::default());
    assert_eq!(parse("# nothing here\n").unwrap(), Settings::default());
}

#[test]
fn missing_file_is_an_error_naming_it() {
    let e = Settings::load("/no/such/tern.yaml").unwrap_err();
    assert!(e.to_string().contains("/no/such/tern.yaml"), "{e}");
}

#[test]
fn flags_have_the_same_names_and_override_the_file() {
    let f = flags(&[
        "--ctx-size",
        "401408",
        "--parallel",
        "2",
        "--cache-type-v",
        "f16",
        "--spec-type",
        "none",
        "--lora-scaled",
        "/x/adapter.gguf:0.5",
        "--jinja",
        "--metrics",
        "false",
        "--n-gpu-layers",
        "-1",
    ]);
    assert_eq!(f.ctx_size, Some(401_408));
    assert_eq!(f.jinja, Some(true));
    assert_eq!(f.metrics, Some(false));
    assert_eq!(f.n_gpu_layers, Some(-1));
    assert_eq!(
        f.lora_scaled,
        Some(vec![LoraScaled {
            path: "/x/adapter.gguf".into(),
            scale: 0.5
        }])
    );
    let file = Settings::load(zealot()).unwrap();
    let m = file.clone().merge(f);
    assert_eq!(m.ctx_size, Some(401_408));
    assert_eq!(m.parallel, Some(2));
    assert_eq!(m.cache_type_v, Some(KvType::F16));
    assert_eq!(m.spec_type, Some(SpecType::None));
    assert_eq!(m.metrics, Some(false));
    // Untouched keys keep the file's values.
    assert_eq!(m.cache_type_k, Some(KvType::F16));
    assert_eq!(m.port, Some(7771));
    assert_eq!(m.model, file.model);
    // No flags: the file as it is.
    assert_eq!(file.clone().merge(Settings::default()), file);
    // Bad flag values are clap errors naming the flag.
    let e = Flags::try_parse_from(["tern", "--cache-type-v", "q9_0"])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--cache-type-v") && e.contains("q9_0"), "{e}");
    assert!(Flags::try_parse_from(["tern", "--port", "-1"]).is_err());
    assert!(Flags::try_parse_from(["tern", "--lora-scaled", "adapter.gguf"]).is_err());
}

#[test]
fn relative_paths_in_a_file_are_relative_to_it() {
    let path = tmp("rel.yaml");
    std::fs::write(
        &path,
        "model: m.gguf\nmmproj: /abs/p.gguf\nlora-scaled: [\"a/l.gguf:1\"]\n",
    )
    .unwrap();
    let s = Settings::load(&path).unwrap();
    let dir = path.parent().unwrap();
    assert_eq!(s.model, Some(dir.join("m.gguf")));
    assert_eq!(s.mmproj, Some(PathBuf::from("/abs/p.gguf")));
    assert_eq!(s.lora_scaled.unwrap()[0].path, dir.join("a/l.gguf"));
}

#[test]
fn print_shows_the_merged_settings_as_yaml_that_parses_back() {
    let args = ConfigArgs {
        config: Some(zealot()),
        print: true,
        settings: flags(&[
            "--parallel",
            "2",
            "--ctx-size",
            "401408",
            "--api-key",
            "s3cret",
        ]),
    };
    let mut out = Vec::new();
    run_to(&args, &mut out).unwrap();
    let y = String::from_utf8(out).unwrap();
    println!("{y}");
    assert!(y.contains("ctx-size: 401408"), "{y}");
    assert!(y.contains("parallel: 2"), "{y}");
    assert!(y.contains("cache-type-v: q8_0"), "{y}");
    assert!(y.contains("spec-draft-n-max: 2"), "{y}");
    assert!(!y.contains("s3cret"), "the API key is redacted: {y}");
    let back = parse(&y).unwrap();
    let mut want = Settings::load(zealot())
        .unwrap()
        .merge(args.settings.clone());
    want.api_key = Some("<redacted>".into());
    assert_eq!(back, want);

    // A bad merged result is refused: the flag breaks the file's divisibility.
    let args = ConfigArgs {
        config: Some(zealot()),
        print: true,
        settings: flags(&["--parallel", "5"]),
    };
    let e = run_to(&args, &mut Vec::new()).unwrap_err();
    assert!(format!("{e:#}").contains("ctx-size"), "{e:#}");
}

/// The wiring `src/main.rs` gets: the three subcommands hold these Args structs.
#[derive(Parser)]
struct Wired {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    Fit(tern::cli::fit::FitArgs),
    Config(ConfigArgs),
    Verify(tern::cli::verify::VerifyArgs),
}

#[test]
fn the_subcommands_are_well_formed_clap() {
    use clap::CommandFactory;
    Wired::command().debug_assert();
    let w = Wired::try_parse_from([
        "tern",
        "fit",
        "--config",
        "z.yaml",
        "-m",
        "m.gguf",
        "--device-mib",
        "24123",
        "--cache-type-v",
        "q8_0",
        "--json",
    ])
    .unwrap();
    let Cmd::Fit(a) = w.cmd else {
        panic!("not fit")
    };
    assert!(a.json);
    assert_eq!(a.config, Some(PathBuf::from("z.yaml")));
    assert_eq!(a.settings.device_mib, Some(24_123));
    assert_eq!(a.settings.cache_type_v, Some(KvType::Q8_0));
    let w = Wired::try_parse_from([
        "tern",
        "verify",
        "--model",
        "m.gguf",
        "--sha256",
        "ab",
        "--bytes",
        "10",
        "--mmproj",
        "p.gguf",
        "--mmproj-sha256",
        "cd",
        "--manifest",
        "f.json",
    ])
    .unwrap();
    let Cmd::Verify(v) = w.cmd else {
        panic!("not verify")
    };
    assert_eq!(v.bytes, Some(10));
    assert_eq!(v.mmproj_sha256.as_deref(), Some("cd"));
    let w = Wired::try_parse_from(["tern", "config", "--print", "--backend", "cpu"]).unwrap();
    let Cmd::Config(c) = w.cmd else {
        panic!("not config")
    };
    assert!(c.print);
    assert_eq!(c.settings.backend, Some(BackendKind::Cpu));
}
