use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("minisgl-cpu-service: not built yet");
    ExitCode::from(2)
}
