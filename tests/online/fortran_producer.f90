! A simulation's producer in Fortran (docs/online.md, "Fortran"): stream.h's functions through
! iso_c_binding, as tests/online/c_producer.c does in C. Under MPMD
! (`mpirun -np 1 online_fortran_producer : -np 2 meshtrain train online_c.toml`) it takes its
! part of MPI_COMM_WORLD by MPI_APPNUM, connects to stream "c-demo" with 4 inputs (or the
! number given as its argument) and 2 outputs, sends 50 sends of 16 rows (backpressure block,
! the same values as c_producer.c; sends share messages, flushed every 10 sends with
! mt_stream_flush, after which every row so far must have been handed to MPI, else exit 1) and
! closes. Exits 2 with the error's sentence when connect fails.

! The interface block docs/online.md shows.
module meshtrain_stream
  use iso_c_binding
  implicit none
  integer(c_int), parameter :: MT_STREAM_FLOAT32 = 0, MT_STREAM_FLOAT64 = 1
  integer(c_int), parameter :: MT_STREAM_DROP = 0, MT_STREAM_BLOCK = 1
  interface
    integer(c_int) function mt_stream_connect_f(comm, name, inputs, outputs, dtype, ring_rows, &
                                                message_rows, backpressure, close_timeout, &
                                                share_messages, stream) &
      bind(C, name="mt_stream_connect_f")
      import :: c_int, c_int64_t, c_char, c_ptr, c_double
      integer(c_int), value :: comm  ! comm%MPI_VAL (mpi_f08) or the integer handle (mpi)
      character(kind=c_char), intent(in) :: name(*)  ! trim(name) // c_null_char
      integer(c_int64_t), value :: inputs, outputs
      integer(c_int), value :: dtype
      integer(c_int64_t), value :: ring_rows, message_rows  ! 0: the defaults
      integer(c_int), value :: backpressure
      real(c_double), value :: close_timeout  ! seconds close waits for the trainer; 0: 120
      integer(c_int), value :: share_messages  ! 1: sends share messages (mt_stream_flush); 0: not
      type(c_ptr), intent(out) :: stream
    end function
    ! With share_messages: the rows waiting in the message being filled go now.
    integer(c_int) function mt_stream_flush(stream) bind(C, name="mt_stream_flush")
      import :: c_int, c_ptr
      type(c_ptr), value :: stream
    end function
    ! x(inputs, rows) and y(outputs, rows): Fortran's column order is C's row-major [rows, n].
    integer(c_int) function mt_stream_send(stream, x, y, rows) bind(C, name="mt_stream_send")
      import :: c_int, c_int64_t, c_ptr
      type(c_ptr), value :: stream
      type(*), intent(in) :: x(*), y(*)
      integer(c_int64_t), value :: rows
    end function
    integer(c_int) function mt_stream_close(stream) bind(C, name="mt_stream_close")
      import :: c_int, c_ptr
      type(c_ptr), value :: stream
    end function
    subroutine mt_stream_free(stream) bind(C, name="mt_stream_free")
      import :: c_ptr
      type(c_ptr), value :: stream
    end subroutine
    integer(c_int64_t) function mt_stream_rows_sent(stream) bind(C, name="mt_stream_rows_sent")
      import :: c_int64_t, c_ptr
      type(c_ptr), value :: stream
    end function
    type(c_ptr) function mt_stream_last_error(stream) bind(C, name="mt_stream_last_error")
      import :: c_ptr
      type(c_ptr), value :: stream
    end function
    integer(c_size_t) function c_strlen(s) bind(C, name="strlen")
      import :: c_size_t, c_ptr
      type(c_ptr), value :: s
    end function
  end interface
contains
  ! The sentence of the last error, as a Fortran string.
  function mt_stream_error(stream) result(message)
    type(c_ptr), intent(in) :: stream
    character(len=:), allocatable :: message
    character(kind=c_char), pointer :: chars(:)
    type(c_ptr) :: text
    integer :: i, n
    text = mt_stream_last_error(stream)
    n = int(c_strlen(text))
    call c_f_pointer(text, chars, [n])
    allocate (character(len=n) :: message)
    do i = 1, n
      message(i:i) = chars(i)
    end do
  end function
end module

program fortran_producer
  use mpi_f08
  use meshtrain_stream
  implicit none
  type(MPI_Comm) :: sim
  integer(MPI_ADDRESS_KIND) :: appnum
  logical :: has_appnum
  integer :: world_rank, rank, step, i, j
  integer(c_int64_t) :: inputs
  integer(c_int64_t), parameter :: outputs = 2, rows = 16
  character(len=16) :: argument
  type(c_ptr) :: stream
  real(c_float), allocatable :: x(:, :), y(:, :)
  real(c_double) :: t

  call MPI_Init()
  call MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, appnum, has_appnum)
  if (.not. has_appnum) appnum = 0
  call MPI_Comm_rank(MPI_COMM_WORLD, world_rank)
  call MPI_Comm_split(MPI_COMM_WORLD, int(appnum), world_rank, sim)
  call MPI_Comm_rank(sim, rank)
  inputs = 4
  if (command_argument_count() > 0) then
    call get_command_argument(1, argument)
    read (argument, *) inputs
  end if

  allocate (x(inputs, rows), y(outputs, rows))
  ! block: every row reaches the trainer, however long it takes to start; sends share messages
  ! (of 256 rows, the default), flushed every 10 sends
  if (mt_stream_connect_f(sim%MPI_VAL, "c-demo"//c_null_char, inputs, outputs, &
                          MT_STREAM_FLOAT32, 0_c_int64_t, 0_c_int64_t, MT_STREAM_BLOCK, &
                          0.0_c_double, 1_c_int, stream) /= 0) then
    write (0, '(a)') "fortran producer: error: "//mt_stream_error(stream)
    call mt_stream_free(stream)
    call MPI_Comm_free(sim)
    call MPI_Finalize()
    stop 2
  end if
  do step = 0, 49
    do i = 1, int(rows)
      t = 0.01d0*(step*rows + (i - 1)) + 0.5d0*rank
      do j = 1, int(inputs)
        x(j, i) = real(sin(t*j), c_float)
      end do
      do j = 1, int(outputs)
        y(j, i) = real(cos(t + (j - 1)), c_float)
      end do
    end do
    if (mt_stream_send(stream, x, y, rows) /= 0) then
      write (0, '(a)') "fortran producer: error: "//mt_stream_error(stream)
      call MPI_Abort(MPI_COMM_WORLD, 1)
    end if
    if (mod(step + 1, 10) == 0) then
      if (mt_stream_flush(stream) /= 0) then
        write (0, '(a)') "fortran producer: error: "//mt_stream_error(stream)
        call MPI_Abort(MPI_COMM_WORLD, 1)
      end if
      ! every row so far handed to MPI: the flush started the shared message
      if (mt_stream_rows_sent(stream) /= (step + 1)*rows) then
        write (0, '(a, i0, a, i0)') "fortran producer: error: after mt_stream_flush ", &
          mt_stream_rows_sent(stream), " rows sent of ", (step + 1)*rows
        call MPI_Abort(MPI_COMM_WORLD, 1)
      end if
    end if
  end do
  if (mt_stream_close(stream) /= 0) write (0, '(a)') "fortran producer: error: "// &
    mt_stream_error(stream)
  print '(a, i0, a, i0, a)', "fortran producer ", rank, ": sent ", mt_stream_rows_sent(stream), " rows"
  call mt_stream_free(stream)
  call MPI_Comm_free(sim)
  call MPI_Finalize()
end program
