use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("text") => minisgl_cpu_service::text::run_text_cli(&args[2..]),
        _ => {
            eprintln!("minisgl-cpu-service: not built yet");
            ExitCode::from(2)
        }
    }
}
