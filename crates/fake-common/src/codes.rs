//! The `CUresult` values the fake driver returns, with the names and strings
//! the real `cuGetErrorName` / `cuGetErrorString` give for them (driver r580).

/// A `CUresult`: a plain C `int`, as in `cuda.h`.
pub type CuResult = i32;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
pub const CUDA_ERROR_OPERATING_SYSTEM: CuResult = 304;
pub const CUDA_ERROR_ILLEGAL_STATE: CuResult = 401;
pub const CUDA_ERROR_NOT_FOUND: CuResult = 500;
pub const CUDA_ERROR_NOT_READY: CuResult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CuResult = 700;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CuResult = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: CuResult = 713;
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

/// `(code, cuGetErrorName, cuGetErrorString)`, NUL-terminated so the C side
/// can hand out pointers into this static table.
const TABLE: &[(CuResult, &str, &str)] = &[
    (CUDA_SUCCESS, "CUDA_SUCCESS\0", "no error\0"),
    (CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE\0", "invalid argument\0"),
    (CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY\0", "out of memory\0"),
    (CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED\0", "initialization error\0"),
    (CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE\0", "no CUDA-capable device is detected\0"),
    (CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE\0", "invalid device ordinal\0"),
    (CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT\0", "invalid device context\0"),
    (
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED\0",
        "part or all of the requested memory range is already mapped\0",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED\0",
        "pointer does not correspond to a registered memory region\0",
    ),
    (
        CUDA_ERROR_OPERATING_SYSTEM,
        "CUDA_ERROR_OPERATING_SYSTEM\0",
        "OS call failed or operation not supported on this OS\0",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        "CUDA_ERROR_ILLEGAL_STATE\0",
        "the operation cannot be performed in the present state\0",
    ),
    (CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND\0", "named symbol not found\0"),
    (CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY\0", "device not ready\0"),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        "CUDA_ERROR_ILLEGAL_ADDRESS\0",
        "an illegal memory access was encountered\0",
    ),
    (CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN\0", "unknown error\0"),
];

/// The NUL-terminated `cuGetErrorName` text, `None` for a code the driver
/// does not know (the real one then answers `CUDA_ERROR_INVALID_VALUE`).
pub fn error_name(code: CuResult) -> Option<&'static str> {
    TABLE.iter().find(|e| e.0 == code).map(|e| e.1)
}

/// The NUL-terminated `cuGetErrorString` text, `None` for an unknown code.
pub fn error_string(code: CuResult) -> Option<&'static str> {
    TABLE.iter().find(|e| e.0 == code).map(|e| e.2)
}

/// `"401 CUDA_ERROR_ILLEGAL_STATE"`: for messages of the fakes themselves.
pub fn describe(code: CuResult) -> String {
    match error_name(code) {
        Some(name) => format!("{code} {}", name.trim_end_matches('\0')),
        None => format!("{code}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_text_is_nul_terminated_once() {
        for (_, name, text) in TABLE {
            assert!(name.ends_with('\0') && name.matches('\0').count() == 1);
            assert!(text.ends_with('\0') && text.matches('\0').count() == 1);
        }
    }

    #[test]
    fn unknown_codes_have_no_name() {
        assert_eq!(error_name(12345), None);
        assert_eq!(error_string(-1), None);
        assert_eq!(describe(401), "401 CUDA_ERROR_ILLEGAL_STATE");
    }
}
