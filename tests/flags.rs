//! llama-server's flag table: every option its `common/arg.cpp` registers for the server
//! (`fixtures/llama-server-flags.json`, written by `cargo xtask llama-flags` from the vendored
//! llama.cpp), each of its spellings, from the command line and from its `LLAMA_ARG_*`
//! variable, is honoured, accepted with a warning naming it, or refused with an error naming
//! it. The summary (counts and every warned and refused flag with its reason) is printed:
//! `cargo test --release --test flags -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use clap::Parser;
use serde_json::Value;
use tern::config::flags::{self, Class, Rewritten};
use tern::config::{Settings, Sources};

/// Any subcommand that flattens the settings (serve, generate, fit, config).
#[derive(Parser, Debug)]
#[command(name = "tern-serve", version, args_override_self = true)]
struct Cmd {
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    s: Settings,
}

struct Opt {
    args: Vec<String>,
    neg: Vec<String>,
    value: bool,
    env: Option<String>,
}

fn llama_options() -> Vec<Opt> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/llama-server-flags.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    doc["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| Opt {
            args: strs(&o["args"]),
            neg: strs(&o["neg"]),
            value: !matches!(o["kind"].as_str(), Some("void" | "bool")),
            env: o["env"].as_str().map(str::to_string),
        })
        .collect()
}

/// A value each option can take (llama.cpp's own examples where they matter).
fn sample(spelling: &str) -> &'static str {
    let canon = flags::lookup(spelling).map(|(o, _)| o.name()).unwrap_or("");
    match canon {
        "--ctx-size" => "8192",
        "--kv-unified-per-slot" => "2048",
        "--n-predict" => "16",
        "--batch-size" => "1024",
        "--ubatch-size" => "256",
        "--threads" | "--threads-batch" | "--threads-http" => "2",
        "--parallel" => "2",
        "--flash-attn" => "on",
        "--cache-type-k" | "--cache-type-v" | "--cache-type-k-draft" | "--cache-type-v-draft" => {
            "q8_0"
        }
        "--spec-type" => "draft-mtp",
        "--reasoning-format" => "none",
        "--pooling" => "mean",
        "--reasoning" => "off",
        "--reasoning-effort" => "low",
        "--reasoning-budget" => "64",
        "--reasoning-budget-message" => "enough thinking",
        "--chat-template" => "chatml",
        "--chat-template-file" => "template.jinja",
        "--chat-template-kwargs" => r#"{"enable_thinking":false}"#,
        "--model" => "model.gguf",
        "--mmproj" => "mmproj.gguf",
        "--lora-scaled" => "adapter.gguf:0.5",
        "--alias" => "frank-zealot",
        "--tags" => "a,b",
        "--host" => "0.0.0.0",
        "--port" => "7771",
        "--api-key" => "k1,k2",
        "--api-key-file" => "keys.txt",
        "--timeout" => "60",
        "--sse-ping-interval" => "5",
        "--log-file" => "tern.log",
        "--log-colors" => "off",
        "--log-verbosity" => "4",
        "--temperature" => "0.5",
        "--top-k" => "20",
        "--top-p" => "0.9",
        "--min-p" => "0.1",
        "--repeat-last-n" => "32",
        "--repeat-penalty" => "1.1",
        "--presence-penalty" => "1.0",
        "--frequency-penalty" => "0.5",
        "--seed" => "42",
        "--reverse-prompt" => "STOP",
        "--spec-draft-n-max" => "2",
        "--spec-draft-n-min" => "1",
        "--draft-p-min" => "0.5",
        "--fit-target" => "512",
        "--n-gpu-layers" => "99",
        "--cors-origins" => "http://localhost:3000",
        "--cors-methods" => "GET, POST",
        "--cors-headers" => "Authorization",
        "--api-prefix" => "/llm",
        _ => "1",
    }
}

/// What the pipeline does with `argv` (a flag and its value): the class, and the message that
/// must name it.
fn outcome(argv: &[String], env: &BTreeMap<String, String>) -> (Class, String, Settings) {
    let named = |class: Class, msg: String| (class, msg, Settings::default());
    let rw = match flags::rewrite(argv) {
        Ok(rw) => rw,
        Err(e) => return named(Class::Refused, e.to_string()),
    };
    let parsed =
        Cmd::try_parse_from(std::iter::once("tern-serve".to_string()).chain(rw.args.clone()));
    let cmd = match parsed {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            return named(Class::Honoured, String::new())
        }
        Err(e) => panic!("{argv:?} → {:?}: clap refused it: {e}", rw.args),
    };
    let given = Rewritten {
        args: Vec::new(),
        notes: rw.notes,
        spellings: rw.spellings,
    };
    let get = |k: &str| env.get(k).cloned();
    let sources = match Sources::gather(None, &get, cmd.s, given) {
        Ok(s) => s,
        Err(e) => return named(Class::Refused, e.to_string()),
    };
    match sources.resolve() {
        Err(e) => named(Class::Refused, e.to_string()),
        Ok(r) if !r.notes.is_empty() => (
            Class::Warned,
            r.notes
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join("; "),
            r.settings,
        ),
        Ok(r) => (Class::Honoured, String::new(), r.settings),
    }
}

#[test]
fn every_llama_server_flag_is_honoured_warned_or_refused() {
    let opts = llama_options();
    assert!(opts.len() > 200, "the fixture lists llama-server's options");
    let mut seen = BTreeSet::new();
    let mut by_class: BTreeMap<Class, Vec<(String, String)>> = BTreeMap::new();
    let no_env = BTreeMap::new();
    for o in &opts {
        for (spelling, negative) in o
            .args
            .iter()
            .map(|a| (a, false))
            .chain(o.neg.iter().map(|a| (a, true)))
        {
            seen.insert(spelling.clone());
            let (opt, neg) = flags::lookup(spelling)
                .unwrap_or_else(|| panic!("{spelling} is not in tern's flag table"));
            assert_eq!(neg, negative, "{spelling}: positive or negative");
            assert_eq!(
                opt.arg == flags::Arg::Value,
                o.value,
                "{spelling}: takes a value in llama.cpp"
            );
            let mut argv = vec![spelling.clone()];
            if o.value {
                argv.push(sample(spelling).to_string());
            }
            let (class, msg, settings) = outcome(&argv, &no_env);
            match class {
                Class::Refused | Class::Warned => {
                    // The message names the flag as the user spelled it.
                    assert!(msg.contains(spelling.as_str()), "{argv:?}: {msg}");
                }
                Class::Honoured => {
                    let how = if neg { opt.how_neg } else { opt.how };
                    if !matches!(how, flags::How::Clap(_)) {
                        assert_ne!(
                            settings,
                            Settings::default(),
                            "{argv:?} is honoured, so it sets something"
                        );
                    }
                }
            }
            // The table's own class, unless the value decides (-ngl 99 changes nothing,
            // --lora-scaled FILE:0.5 is refused).
            let how = if neg { opt.how_neg } else { opt.how };
            let value_decides = matches!(opt.name(), "--n-gpu-layers" | "--lora-scaled");
            if !value_decides {
                assert_eq!(how.class(), class, "{argv:?}: {msg}");
            }
            let why = msg
                .split(": ignored: ")
                .nth(1)
                .or_else(|| msg.split(": not supported: ").nth(1))
                .unwrap_or(&msg)
                .to_string();
            by_class
                .entry(class)
                .or_default()
                .push((argv.join(" "), why));

            // The same flag from its environment variable (a negative spelling also reads
            // LLAMA_ARG_NO_*), with the same outcome.
            if let Some(var) = &o.env {
                let (var, value) = match (negative, o.value) {
                    (true, _) => (var.replace("LLAMA_ARG_", "LLAMA_ARG_NO_"), "1".to_string()),
                    (false, true) => (var.clone(), sample(spelling).to_string()),
                    (false, false) => (var.clone(), "1".to_string()),
                };
                let env = BTreeMap::from([(var.clone(), value.clone())]);
                let (env_class, env_msg, env_settings) = outcome(&[], &env);
                if !var.contains("_NO_") || !o.neg.is_empty() {
                    assert_eq!(env_class, class, "{var}={value}: {env_msg}");
                    if class == Class::Honoured {
                        assert_eq!(
                            env_settings, settings,
                            "{var}={value} sets what {spelling} sets"
                        );
                    } else {
                        assert!(env_msg.contains(&var), "{var}: {env_msg}");
                    }
                }
            }
        }
    }
    // Nothing in tern's table that llama-server does not accept.
    for o in flags::OPTIONS {
        for s in o.names.iter().chain(o.neg.iter()) {
            assert!(
                seen.contains(*s),
                "{s} is in tern's table but not in llama-server's"
            );
        }
    }
    let count = |c| by_class.get(&c).map_or(0, Vec::len);
    println!(
        "llama-server flag table: {} spellings of {} options: {} honoured, {} warned, {} refused",
        seen.len(),
        opts.len(),
        count(Class::Honoured),
        count(Class::Warned),
        count(Class::Refused)
    );
    for class in [Class::Warned, Class::Refused] {
        println!("\n{class:?}:");
        for (flag, why) in by_class.get(&class).into_iter().flatten() {
            println!("  {flag}: {why}");
        }
    }
    println!("\nHonoured:");
    let honoured: Vec<&str> = by_class
        .get(&Class::Honoured)
        .into_iter()
        .flatten()
        .map(|(f, _)| f.as_str())
        .collect();
    println!("  {}", honoured.join(", "));
}

#[test]
fn the_issue_command_line_parses() {
    // `tern serve -m M.gguf -ngl 99 -fa on -np 4 -ctk q8_0` stopped at `-n` before.
    let argv: Vec<String> = [
        "-m", "M.gguf", "-ngl", "99", "-fa", "on", "-np", "4", "-ctk", "q8_0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (class, msg, s) = outcome(&argv, &BTreeMap::new());
    assert_eq!(class, Class::Warned, "{msg}");
    assert!(msg.contains("-ngl 99"), "{msg}");
    assert_eq!(s.parallel, Some(4));
    assert_eq!(s.cache_type_k, Some(tern::plan::KvType::Q8_0));
    assert_eq!(s.flash_attn, Some(tern::plan::FlashAttn::On));
    assert_eq!(s.model.as_deref(), Some(Path::new("M.gguf")));
}

#[test]
fn spellings_underscores_repeats_and_negatives() {
    let rw = flags::rewrite(&[
        "--ctx_size",
        "4096",
        "--no-webui",
        "--metrics",
        "-c",
        "8192",
    ])
    .unwrap();
    assert_eq!(
        rw.args,
        ["--webui=false", "--metrics=true", "--ctx-size=8192"],
        "underscores read as dashes; the last of a repeated flag wins"
    );
    assert!(rw
        .notes
        .iter()
        .any(|n| n.to_string().contains("last value")));
    // llama.cpp's repack switch sets tern's packing of the CPU's matrices.
    let rw = flags::rewrite(&["-nr"]).unwrap();
    assert_eq!(rw.args, ["--repack=false"]);
    let rw = flags::rewrite(&["--repack"]).unwrap();
    assert_eq!(rw.args, ["--repack=true"]);
    // A flag with `=`, a boolean's value, and a missing value.
    let rw = flags::rewrite(&["--port=9000", "--slots=false"]).unwrap();
    assert_eq!(rw.args, ["--port=9000", "--slots=false"]);
    assert!(flags::rewrite(&["-c"]).is_err());
    // tern's own flags pass through to clap.
    let rw = flags::rewrite(&["--backend", "cpu", "--device-mib", "100"]).unwrap();
    assert_eq!(rw.args, ["--backend", "cpu", "--device-mib", "100"]);
}
