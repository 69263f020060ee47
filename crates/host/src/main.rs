//! The `kvpages` binary: parses the command line and hands over to the library.

fn main() -> std::process::ExitCode {
    kvpages_host::cli::main()
}
